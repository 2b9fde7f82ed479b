"""The parameter server runtime: the coordinator (coordinator.py) behind a gRPC service, on the
real clock, with a write-ahead log.

`ServerRuntime` has the runtime interface of runtime/__init__.py, so `diloco serve` is `diloco
train`'s loop (evaluation, metrics, checkpoints, summary) with this runtime: its main thread
decides (rounds, jobs, grace windows, leases) and applies outer steps; gRPC threads answer the
workers (handlers.py). Both go through the shared `ServerState` (state.py), which logs every
event durably before applying it; `Endpoint` (endpoint.py) listens and says where.

    diloco serve --out runs/srv --port 7000      # then: diloco worker --server localhost:7000
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diloco import rundir
from diloco.config import TrainConfig
from diloco.core.outer_side import OuterSide
from diloco.errors import UserError
from diloco.runtime import SideView
from diloco.runtime.server import heap
from diloco.runtime.server.endpoint import Endpoint
from diloco.runtime.server.jobs import Job
from diloco.runtime.server.security import ServeOptions
from diloco.runtime.server.state import ServerState, log

TICK_S = 0.2  # how often the main thread looks at leases and deadlines while it waits
NOTE_S = 30.0  # a wait says why after this long, then after twice as long each time it goes on


class ServerRuntime(SideView):
    """The server's side of a run (see the module docstring). `opts.listen` is HOST:PORT (port 0:
    any free port; the address is written to RUN_DIR/server.json)."""

    is_main = True
    sim_time_s = None

    def __init__(
        self,
        cfg: TrainConfig,
        side: OuterSide,
        shard_sizes: list[int],
        run_dir: Path,
        opts: ServeOptions | None,
        shard_plan: str = "",
    ):
        opts = opts or ServeOptions()
        self.cfg, self.side, self.run_dir, self.opts = cfg, side, run_dir, opts
        self._lock = rundir.lock(run_dir)  # one server per run directory, before anything is written
        self._fresh = not (run_dir / "checkpoints").exists()  # a new run, not a resumed one
        self._discard = False  # a new run that could not start serving leaves no run directory
        heap.limit_arenas()  # before the gRPC threads start (runtime/server/heap.py)
        heap.map_large()
        self.state = ServerState(cfg, side, shard_sizes, run_dir, opts, shard_plan)
        st = self.state
        self.coord, self.cond, self.refusals = st.coord, st.cond, st.refusals
        self.max_message_bytes = st.max_message_bytes
        self.endpoint = Endpoint(st, opts, self._lock)
        self._group: list[int] = []  # async: jobs of the grace group still to apply
        self._closed_t: float | None = None  # streaming: when the last round closed (its timing)

    # -- the runtime interface -----------------------------------------------------------------
    num_workers = property(lambda self: self.cfg.num_workers)
    step_budget = property(lambda self: self.coord.step_budget)
    applied = property(lambda self: self.coord.applied)
    done = property(lambda self: self.coord.finished and not self.state.replaying)
    planner = property(lambda self: self.coord.planner)  # sync DiLoCo with DyLU, or None
    at_boundary = property(lambda self: not self._group)
    address = property(lambda self: self.endpoint.address)  # HOST:PORT once it serves
    run = property(lambda self: self.state.run)
    failure = property(  # set by a handler (or a test, lock held): the main thread raises it
        lambda self: self.state.failure, lambda self, error: self.state.fail(error)
    )

    def broadcast(self, obj: Any) -> Any:
        return obj

    def round(self, *, active: int | None = None):
        """One sync round: every registered worker (all k for the first round) gets a job; the
        round closes when each has pushed or left, or when --round-timeout-s passes."""
        if (replayed := self.state.replay_next()) is not None:
            return replayed
        self._start()
        c, st = self.coord, self.state
        with self.cond:
            if not c.members:  # else the round the server was in when it stopped goes on
                need = self.num_workers if self.side.rounds_done == 0 else 1
                self._wait(
                    lambda: len(c.workers) >= need, lambda: f"{len(c.workers)} of {need} workers registered"
                )
                members = sorted(c.workers)
                st.record({"kind": "begin", "round": self.side.rounds_done + 1, "members": members})
                for w in members:
                    st.dispatch(c.plan_dispatch(w, time.time()))
            t0, ids = c.round_t, list(c.jobs)
            timeout = self.cfg.round_timeout_s or float("inf")
            if c.schedule is None:
                self._wait(lambda: not c.jobs or time.time() >= t0 + timeout, lambda: f"{len(c.jobs)} pushes")
                computes = [push["compute_s"] for push, _ in c.inbox.values()]
            else:
                computes = self._fragments(t0 + timeout)
            stats = st.record({"kind": "close", "round": self.side.rounds_done + 1})
            started = st.first_served(ids)  # its training part: from the first job on the wire
        now, begin = time.time(), (t0 if started is None else max(t0, started))
        if c.schedule is not None and self._closed_t is not None:
            begin = self._closed_t  # streaming: from the last round's close (see _fragments)
        self._closed_t = now if c.schedule is not None else None
        wall_s = now - begin
        compute_s = sum(computes) / len(computes) if computes else 0.0
        stats.timing = {"compute_s": compute_s, "comm_s": max(0.0, wall_s - compute_s)}
        return stats

    def _fragments(self, deadline: float) -> list[float]:
        """Streaming DiLoCo (fragments.py): each fragment's outer step once every member whose
        job is alive pushed it, or at the round's `deadline` (--round-timeout-s) without the late
        ones, who are then made to leave (they join again as fresh workers). Returns the compute
        seconds of the jobs that finished, as far as the round's timing window reaches. Lock held.

        The rounds overlap: a worker trains on τ steps past its last push, the next round's
        first τ. So a round's window runs from the last round's close to this one's (its first,
        from its first job on the wire): H steps of a worker that went on from its own θ, H − τ
        of one that started afresh in it."""
        c, st, r = self.coord, self.state, self.side.rounds_done + 1
        H, tau = c.schedule.inner_steps, c.schedule.overlap_steps
        fresh = {job.worker for job in c.jobs.values() if not job.keep}
        for p in range(c.closed, c.schedule.fragments):  # after a resume: from where the log stopped
            self._wait(
                lambda p=p: c.fragment_ready(p) or time.time() >= deadline,
                lambda p=p: f"fragment {p} from {len(c.jobs) - len(c.fragment_in.get(p, {}))} workers",
            )
            st.record({"kind": "fragment", "round": r, "fragment": p})
        for job in list(c.jobs.values()):  # its last fragment did not come in time
            st.leave(job.worker, "late")
        return [
            push["compute_s"] * ((H - tau) / H if w in fresh else 1.0) for w, push in c.last_pushes.items()
        ]

    def step(self):
        """Async: apply the next arrived outer_grad (with a grace period, the pushes that land
        before the window closes form a group, applied one per call, whose workers then restart
        together); hands out jobs to idle workers. None when the budget is spent."""
        if (replayed := self.state.replay_next()) is not None:
            return replayed
        self._start()
        c, st = self.coord, self.state
        with self.cond:
            while True:
                if self._group:
                    job = self._group.pop(0)  # group_end: the last of its grace group (DN's momentum step)
                    # durable with the next job's dispatch, which GetJob syncs before it goes out
                    return st.record({"kind": "apply", "job": job, "group_end": not self._group}, sync=False)
                if c.finished:
                    return None
                st.reap()
                for w in c.idle():
                    if not st.may_hand_out():  # --max-inflight-downloads: θ copies at their limit
                        break
                    event = c.plan_dispatch(w, time.time())
                    if event is None:
                        break
                    st.dispatch(event)  # durable before it goes out: GetJob syncs the log to it
                if c.arrived:
                    self._group = self._grace_group()
                elif c.dispatched >= c.step_budget and not c.jobs:  # deadline jobs may overshoot
                    st.record({"kind": "flush"})
                    return None
                else:
                    self._wait_once()
                    if not c.workers and not c.jobs:
                        self._note(lambda: "no worker registered")

    def _grace_group(self) -> list[int]:
        """Wait for the pushes expected within the grace period (all in flight whose speed is not
        known yet, or due before it ends), at most until it ends; the arrived pushes are the group."""
        c = self.coord
        grace = c.grace_s()
        if grace > 0:
            push, _, job = c.arrived[0]
            # a deadline job that landed early opens its window at its deadline (grace_close)
            opens = job.t + job.seconds if job.seconds is not None else push["t"]
            end = max(push["t"], opens) + grace

            def expected() -> list[Job]:
                return [j for j in c.jobs.values() if (due := c.due(j)) is None or due <= end]

            self._wait(lambda: not expected() or time.time() >= end, lambda: "the grace period")
        return [push["job"] for push, _, _ in c.arrived]

    def summary_extras(self) -> dict[str, Any]:
        with self.cond:
            return {**self.state.summary(), "server_address": self.address}

    def state_dict(self) -> dict[str, Any]:
        with self.cond:
            server = self.state.state_dict()
            return {"outer": self.side.state_dict(), "workers": [], "runtime": {"server": server}}

    def after_checkpoint(self) -> None:
        self.state.after_checkpoint()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore the checkpoint, then replay the write-ahead log's later events: the state is
        what it was when the server stopped, with every acknowledged push in it."""
        if state is None:
            return
        s = state.get("runtime", {}).get("server")
        if s is None:
            raise UserError("this checkpoint is not a server run's; continue it with diloco train --resume.")
        self.side.load_state_dict(state["outer"])
        self.state.load_state_dict(s)

    def attach_run(self, run) -> None:
        """The run whose metrics.jsonl gets a `rejected` line for every refused push."""
        self.state.attach_run(run)

    def close(self, *, clean: bool = True) -> None:
        self.endpoint.close(clean=clean)
        self.state.close()
        self._lock.close()
        if self._discard:  # a new run whose port was taken: a retry with the same --out must work
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- the main thread's helpers (called with the lock held) ---------------------------------
    def _wait_once(self) -> None:
        self.state.raise_failure()
        self.cond.wait(TICK_S)
        self.state.raise_failure()

    def _wait(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        while True:
            self.state.reap()
            if ready():
                return
            self._wait_once()
            self._note(lambda: f"waiting for {what()}")

    def _note(self, text: Callable[[], str]) -> None:
        """Called every tick of a wait: a stuck run says why on stderr once it has waited NOTE_S,
        and again after twice as long each time the same wait goes on (30 s, 60 s, 2 min, ...)."""
        now, line = time.time(), text()
        last = getattr(self, "_noting", None)  # (line, last call, last said or begun, gap)
        if last is None or last[0] != line or now - last[1] > 1.0:  # another wait begins
            self._noting = (line, now, now, NOTE_S)
        elif now - last[2] >= last[3]:
            log(line)
            self._noting = (line, now, now, 2 * last[3])
        else:
            self._noting = (line, now, last[2], last[3])

    def _start(self) -> None:
        """Start serving, once: listen, write server.json, say where workers reach the run."""
        if self.endpoint.server is not None:
            return
        self._discard = self._fresh  # until it serves: see close()
        heap.give_back()  # what the start's evaluation freed (32k-vocabulary logits: GBs at 150m)
        self.state.begin_serving()
        self.endpoint.start()
        self._discard = False
        self.endpoint.announce()
