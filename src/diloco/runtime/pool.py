"""Where the simulator's workers compute: inline in this process, or spread over P processes.

Both pools take jobs "worker w: start from these parameters, run this many inner steps" and
hand back its InnerResult. The simulator decides the order of events from its virtual clock
alone, and each worker's computation depends only on its own state and the parameters it is
given, so results are bit-identical whatever the number of processes (at one intra-op thread
per process). A worker lives in one process for the whole run; workers are spread so that the
processes' expected loads are even (`balanced_assignment`).

    diloco train --workers 8 --procs 2
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import torch

from diloco.inner import InnerResult, Worker

WorkerFactory = Callable[[int], Worker]


def balanced_assignment(loads: list[float], procs: int) -> list[int]:
    """worker -> process: heaviest first onto the least-loaded process (ties: lower index), so
    that P processes finish their share at about the same time. Equal loads give w mod P."""
    totals = [0.0] * procs
    assign = [0] * len(loads)
    for w in sorted(range(len(loads)), key=lambda w: (-loads[w], w)):
        p = min(range(procs), key=lambda p: (totals[p], p))
        assign[w] = p
        totals[p] += loads[w]
    return assign


class InlinePool:
    """Workers in this process; a job runs when its result is asked for.

    `threads`, if given, is the intra-op thread count for jobs (restored afterwards): the
    simulator uses 1 so results do not depend on how many processes compute them.
    """

    def __init__(self, workers: list[Worker], *, threads: int | None = None):
        self.workers = workers
        self.threads = threads
        self._jobs: dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.workers)

    def submit(
        self,
        w: int,
        start: list[torch.Tensor] | None,
        steps: int,
        *,
        lr_step: int | None = None,
        shard: int | None = None,
    ) -> None:
        """Queue worker w's job (see Worker.run); the start parameters are copied now, since the
        caller's may change before the job runs."""
        self._jobs[w] = (
            None if start is None else [t.detach().clone() for t in start],
            steps,
            lr_step,
            shard,
        )

    def result(self, w: int) -> InnerResult:
        start, steps, lr_step, shard = self._jobs.pop(w)
        before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            return self.workers[w].run(start, steps, lr_step=lr_step, shard=shard)
        finally:
            torch.set_num_threads(before)

    def state_dict(self) -> list[dict[str, Any]]:
        return [w.state_dict() for w in self.workers]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for worker, state in zip(self.workers, states, strict=True):
            worker.load_state_dict(state)

    def close(self) -> None:
        pass


def _serve(conn, factory: WorkerFactory, ids: list[int], threads: int) -> None:
    torch.set_num_threads(threads)
    pool = InlinePool([factory(w) for w in ids])
    index = {w: i for i, w in enumerate(ids)}
    while True:
        cmd, args = conn.recv()
        if cmd == "run":
            w, start, steps, lr_step, shard = args
            pool.submit(index[w], start, steps, lr_step=lr_step, shard=shard)
            conn.send(pool.result(index[w]))
        elif cmd == "state":
            conn.send(pool.state_dict())
        elif cmd == "load":
            pool.load_state_dict(args)
            conn.send(None)
        else:
            conn.close()
            return


class ProcessPool:
    """Workers spread over `procs` spawned processes with `threads` intra-op threads each.

    `factory(w)` builds worker w inside its process, so it must be picklable (a module-level
    function or a functools.partial of one). Jobs for different processes run at the same time;
    a process runs its own jobs in the order they were submitted.
    """

    def __init__(
        self,
        factory: WorkerFactory,
        num_workers: int,
        procs: int,
        *,
        threads: int = 1,
        assignment: list[int] | None = None,
    ):
        self.num_workers = num_workers
        self.procs = min(procs, num_workers)
        # worker -> process; by default round robin (w mod P)
        self.assign = (
            list(assignment) if assignment is not None else [w % self.procs for w in range(num_workers)]
        )
        self.members = [[w for w in range(num_workers) if self.assign[w] == p] for p in range(self.procs)]
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for p in range(self.procs):
            parent, child = ctx.Pipe()
            ids = self.members[p]
            proc = ctx.Process(target=_serve, args=(child, factory, ids, threads), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._queued: list[list[int]] = [[] for _ in range(self.procs)]  # submitted, not yet received
        self._done: dict[int, InnerResult] = {}

    def __len__(self) -> int:
        return self.num_workers

    def submit(
        self,
        w: int,
        start: list[torch.Tensor] | None,
        steps: int,
        *,
        lr_step: int | None = None,
        shard: int | None = None,
    ) -> None:
        p = self.assign[w]
        # Clone: torch pickles tensors for multiprocessing by sharing their memory, and the
        # caller's parameters change (the server applies updates) while the job runs.
        start = None if start is None else [t.detach().clone() for t in start]
        self._conns[p].send(("run", (w, start, steps, lr_step, shard)))
        self._queued[p].append(w)

    def result(self, w: int) -> InnerResult:
        p = self.assign[w]
        while w not in self._done:
            self._done[self._queued[p].pop(0)] = self._conns[p].recv()
        return self._done.pop(w)

    def state_dict(self) -> list[dict[str, Any]]:
        if any(self._queued):
            raise RuntimeError("ProcessPool.state_dict with jobs in flight; collect their results first")
        states: list[Any] = [None] * self.num_workers
        for p, conn in enumerate(self._conns):
            conn.send(("state", None))
            for w, state in zip(self.members[p], conn.recv(), strict=True):
                states[w] = state
        return states

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for p, conn in enumerate(self._conns):
            conn.send(("load", [states[w] for w in self.members[p]]))
            conn.recv()

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
