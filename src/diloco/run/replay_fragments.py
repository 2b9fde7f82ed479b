"""`diloco replay` of a Streaming DiLoCo server run (run/replay.py; docs/server.md, "Streaming
DiLoCo"): each worker runs its round's segments (core/streaming.py) as far as the event log shows
it got, exactly as `diloco worker` ran them (run/streaming_job.py).

A worker's push of fragment p comes up: it runs its segments through the one that sends p (their
merges take the fragments' values from the replayed θ: a fragment is merged after its outer step
and before the next round's step on it, which the log's order guarantees) and that send's message
is the push's. A refused fragment ends the worker's job there, as it does the real worker's. At
the round's close every job still running runs to its end (the last merge); a worker that left
(or was made to) runs no more of its job, and joins again as a fresh worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.core.codec import Encoded
from diloco.core.inner import Worker
from diloco.runtime.server.coordinator import Coordinator
from diloco.runtime.server.jobs import Job


@dataclass
class _Running:
    worker: Worker
    job: Job
    next: int = 0  # the next segment to run


class FragmentReplay:
    """The Streaming DiLoCo jobs of a replay, by worker slot."""

    def __init__(self, coord: Coordinator):
        self.coord = coord
        self.segments = coord.schedule.segments()
        self.running: dict[int, _Running] = {}

    def on_event(self, kind: str, event: dict[str, Any], workers: dict[int, Worker]) -> Encoded | None:
        """Before `event` is applied: run what its worker computed for it; the message of a push."""
        w = event.get("worker")
        if kind == "push":
            return self._advance(w, event["fragment"]).message
        if kind == "reject" and event["abandon"] and "fragment" in event:
            self._advance(w, event["fragment"])
            del self.running[w]
        elif kind == "leave":
            self.running.pop(w, None)
        elif kind == "close":
            for slot in list(self.running):
                self._advance(slot, None)
                del self.running[slot]
        return None

    def dispatched(self, job: Job, workers: dict[int, Worker]) -> None:
        self.running[job.worker] = _Running(workers[job.worker], job)

    def _advance(self, w: int, send: int | None):
        """Worker w's segments through the one that sends fragment `send` (None: to the end)."""
        run, coord = self.running[w], self.coord
        groups, alpha = coord.groups, coord.schedule.alpha
        result = None
        while run.next < len(self.segments):
            seg, job = self.segments[run.next], run.job
            kwargs: dict[str, Any] = {}
            if run.next == 0:
                run.worker.batches.seek(job.shard, job.position)
                run.worker.step = job.lr_step
                if not job.keep:
                    kwargs["start"], kwargs["anchor"] = job.pulled, job.pulled
            if seg.merge is not None:
                merged = coord.merged(job.round, seg.merge)
                if merged is None:
                    raise ValueError(f"fragment {seg.merge} of round {job.round} is merged before its step")
                kwargs["merge"] = (groups[seg.merge], [t.detach().clone() for t in merged], alpha)
            if seg.send is not None:
                kwargs["send"] = (seg.send, groups[seg.send])
            result = run.worker.segment(seg.steps, **kwargs)
            run.next += 1
            if send is not None and seg.send == send:
                return result
        if send is not None:
            raise ValueError(f"worker {w}'s job {run.job.job} has no fragment {send} to send")
        return result
