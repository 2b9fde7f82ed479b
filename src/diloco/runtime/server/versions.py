"""θ held per version for the workers' downloads (a mixin of state.py's ServerState): each
version's message is made once and streamed to every job of it from its tensors; an async job
lets its θ go once it went out whole (asked for again, the job is given back: `regive`), and
at most --max-inflight-downloads versions are held at once, a copy of θ each (a job waits to
be handed out for one: `may_hand_out`). Sync rounds share one θ and hold it for the round.

    python -m pytest tests/integration/test_server_hostile.py -k "theta or download or again"
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from diloco.core.async_rules import DelayComp
from diloco.core.codec import Encoded
from diloco.runtime.server.jobs import Job
from diloco.runtime.server.wire import message_stream


class Versions:
    """Methods of ServerState (state.py) about θ's versions; they use its lock, coordinator,
    outer side, `_messages`, `_theta0`, `downloads`, `_waiting_since` and `streaming` (the jobs
    whose θ is being sent now)."""

    def params_stream(self, job: Job, pulled: list[torch.Tensor]) -> tuple[int, Iterator[bytes]]:
        """θ of job's version (`pulled`: job.pulled, read under the lock) streamed from its
        message's tensors (wire.message_stream), never joined into one blob. (its length, its
        pieces)."""
        return message_stream(self._version_message(job.version, pulled))

    def downloaded(self, job: Job) -> None:
        """Job's θ went out whole (or the worker had it): an async job lets it go, so θ is held
        per version only while a download needs it, not for every job in flight (unless the rule
        reads it when the push is applied: delaycomp). Asked for again, the job is given back
        (`regive`)."""
        if self._keeps_theta():
            return
        with self.cond:
            self._let_go([job])
            self.cond.notify_all()  # the main thread may hand out a job now (`may_hand_out`)

    def _keeps_theta(self) -> bool:
        """Whether every job keeps its θ until it is pushed: sync rounds (one θ shared by the
        round), Streaming DiLoCo, and delaycomp (its rule reads the θ a job pulled)."""
        c = self.coord
        return c.sync or c.schedule is not None or isinstance(self.side.update, DelayComp)

    def _let_go(self, jobs: list[Job]) -> None:
        """These jobs' θ is no longer held (asked for again, they are given back). Lock held."""
        for job in jobs:
            job.pulled = None
        live = self._held()
        self._messages = {v: m for v, m in self._messages.items() if v in live}
        self.coord.release_pulled(live)

    def _held(self) -> set[int]:
        """The versions of θ held for downloads (jobs whose θ has not gone out yet). Lock held."""
        return {j.version for j in self.coord.jobs.values() if j.pulled is not None}

    def may_hand_out(self) -> bool:
        """Async: whether a job may be handed out now: the θ it starts from is held already, or
        fewer versions than --max-inflight-downloads are (each a copy of θ). At the limit, jobs
        whose download has not begun (a worker slow to ask, or gone until its lease runs out)
        let their θ go first (they are given back when asked for: `regive`), so only downloads
        in progress make a job wait. Lock held."""
        if self._keeps_theta():  # no limit: each job holds its θ to the end
            return True
        held, now = self._held() | {self.coord.side.version}, time.monotonic()
        if len(held) > self.downloads["limit"]:
            idle = [
                j for j in self.coord.jobs.values() if j.pulled is not None and j.job not in self.streaming
            ]
            self._let_go(idle)
            held = self._held() | {self.coord.side.version}
        if len(held) > self.downloads["limit"]:
            self._waiting_since = self._waiting_since or now
            return False
        if self._waiting_since is not None:
            self.downloads["waited_s"] = round(self.downloads["waited_s"] + now - self._waiting_since, 3)
            self._waiting_since = None
        self.downloads["most_held"] = max(self.downloads["most_held"], len(held))
        return True

    def own_theta(self, job: Job, theta: str) -> bool:
        """Whether job's θ is the one a worker built from the run's settings (`theta`: its digest,
        WorkerRef.theta), so the job goes without it: the run's first version only (every worker
        builds that one from the seed, or the same --init-from file); its digest is made once."""
        pulled = job.pulled
        if not theta or job.version != 0 or job.keep or (self._theta0 is None and pulled is None):
            return False
        if self._theta0 is None:
            self._theta0 = self._version_message(0, pulled).digest()
        return theta == self._theta0

    def _version_message(self, version: int, pulled: list[torch.Tensor]) -> Encoded:
        """θ of `version` (`pulled`) as the download codec sends it, made once per version and
        shared by its jobs (fp32: θ's copy itself; bf16: its half-size encoding) while a job
        needs it. One thread makes it while the others asking wait (each making its own took
        16 × 0.5 GB at once when 16 workers of a 150m model asked for a new version together)."""
        with self._making:
            with self.cond:
                message = self._messages.get(version)
            if message is None:
                message = self.coord.download_message(pulled)
                with self.cond:
                    live = self._held()
                    self._messages = {v: m for v, m in self._messages.items() if v in live}
                    self._messages[version] = message
        return message
