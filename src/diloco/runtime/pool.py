"""Where the simulator's workers compute: inline in this process, or spread over P processes.

Both pools take jobs "worker w: start from these parameters, run this many inner steps" and
hand back its InnerResult. The simulator decides the order of events from its virtual clock
alone, and each worker's computation depends only on its own state and the parameters it is
given, so results are bit-identical whatever the number of processes (at one intra-op thread
per process). A worker lives in one process for the whole run; workers are spread so that the
processes' expected loads are even (`balanced_assignment`).

A worker process that dies (killed, out of memory) or whose worker raises is a `WorkerDied`
naming the process, its workers and what it was doing, never a hang or a bare EOFError: the
parent waits for a reply while checking that the process is alive, and a process sends back
the exception of a failing worker (its traceback goes to stderr) before it exits.

    diloco train --workers 8 --procs 2
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from diloco.core.inner import InnerResult, Worker
from diloco.errors import RESUME_OR, WorkerDied

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
        **job: Any,
    ) -> None:
        """Queue worker w's job (see Worker.run: `job` holds its keyword arguments, lr_step,
        shard, lr_stride, seconds); the start parameters are copied now, since the caller's may
        change before the job runs."""
        start = None if start is None else [t.detach().clone() for t in start]
        self._jobs[w] = ("run", (start, steps), job)

    def submit_segment(self, w: int, steps: int, **kwargs: Any) -> None:
        """Queue part of a Streaming DiLoCo round for worker w (see Worker.segment); tensors are
        copied now."""
        copied = {k: _copied(v) for k, v in kwargs.items()}
        self._jobs[w] = ("segment", (steps,), copied)

    def result(self, w: int) -> InnerResult:
        method, args, kwargs = self._jobs.pop(w)
        before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            return getattr(self.workers[w], method)(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    def state_dict(self) -> list[dict[str, Any]]:
        return [w.state_dict() for w in self.workers]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for worker, state in zip(self.workers, states, strict=True):
            worker.load_state_dict(state)

    def close(self) -> None:
        pass


def _copied(value: Any) -> Any:
    """Tensors (also inside tuples and lists) copied; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


class _Sender:
    """Sends messages on a pipe from its own thread, in order.

    Messages go by value with the standard pickle, not multiprocessing's, for which torch shares
    a tensor's memory through a file descriptor handed over by a helper thread (a process killed
    mid-handover leaves that thread printing an EOFError traceback). By value, a job or a result
    is a few MB, more than a pipe holds: sending from a thread lets each side go on computing or
    reading while the other is busy, instead of both blocking on a full pipe. The first error
    (the other side is gone) is kept in `error` and ends the thread.
    """

    def __init__(self, conn):
        self.conn = conn
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        self._queue.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _run(self) -> None:
        while (blob := self._queue.get()) is not None:
            try:
                self.conn.send_bytes(blob)
            except (OSError, EOFError, ValueError) as e:
                self.error = e
                return

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (waiting at most `timeout`), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)


def _read(conn) -> Any:
    return pickle.loads(conn.recv_bytes())


def _serve(conn, factory: WorkerFactory, ids: list[int], threads: int) -> None:
    """A worker process: build workers `ids`, then answer commands with ("ok", value) until told
    to close. A failing worker is answered with ("error", what happened), and the process exits."""
    # Ctrl-C reaches every process of the terminal: the parent decides what happens and closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    doing = "starting"
    out = _Sender(conn)
    try:
        workers = []
        for w in ids:
            doing = f"building worker {w}"
            workers.append(factory(w))
        pool = InlinePool(workers)
        index = {w: i for i, w in enumerate(ids)}
        while True:
            doing = "waiting for a command"
            cmd, args = _read(conn)
            if cmd == "run":
                w, start, steps, job = args
                doing = f"computing worker {w}"
                pool.submit(index[w], start, steps, **job)
                out.send(("ok", pool.result(index[w])))
            elif cmd == "segment":
                w, steps, kwargs = args
                doing = f"computing worker {w}"
                pool.submit_segment(index[w], steps, **kwargs)
                out.send(("ok", pool.result(index[w])))
            elif cmd == "state":
                doing = "getting its workers' state"
                out.send(("ok", pool.state_dict()))
            elif cmd == "load":
                doing = "loading its workers' state"
                pool.load_state_dict(args)
                out.send(("ok", None))
            else:
                out.close()
                conn.close()
                return
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone: nobody to tell
    except Exception as e:
        traceback.print_exc()
        try:
            out.send(("error", f"{doing} raised {e!r}"))
            out.close()
        except Exception:
            pass
        conn.close()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "closed its pipe"
    if code < 0:
        try:
            return f"died with exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"died with exit code {code}"


class ProcessPool:
    """Workers spread over `procs` spawned processes with `threads` intra-op threads each.

    `factory(w)` builds worker w inside its process, so it must be picklable (a module-level
    function or a functools.partial of one). Jobs for different processes run at the same time;
    a process runs its own jobs in the order they were submitted. A process that dies or whose
    worker raises makes every later call that needs it raise `WorkerDied`; `close` still works.
    """

    poll_s = 1.0  # how often a wait for a reply checks that the process is still alive

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
        self._conns, self._procs, self._senders = [], [], []
        for p in range(self.procs):
            parent, child = ctx.Pipe()
            ids = self.members[p]
            proc = ctx.Process(target=_serve, args=(child, factory, ids, threads), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
            self._senders.append(_Sender(parent))
        self._queued: list[list[int]] = [[] for _ in range(self.procs)]  # submitted, not yet received
        self._done: dict[int, InnerResult] = {}
        self._failed: list[str | None] = [None] * self.procs  # why process p is gone

    def __len__(self) -> int:
        return self.num_workers

    def submit(
        self,
        w: int,
        start: list[torch.Tensor] | None,
        steps: int,
        **job: Any,
    ) -> None:
        p = self.assign[w]
        start = None if start is None else [t.detach() for t in start]  # pickled (copied) now
        self._send(p, ("run", (w, start, steps, job)), f"receiving a job for worker {w}")
        self._queued[p].append(w)

    def submit_segment(self, w: int, steps: int, **kwargs: Any) -> None:
        p = self.assign[w]  # tensors are pickled (copied) now
        self._send(p, ("segment", (w, steps, kwargs)), f"receiving a job for worker {w}")
        self._queued[p].append(w)

    def result(self, w: int) -> InnerResult:
        p = self.assign[w]
        while w not in self._done:
            head = self._queued[p][0]
            self._done[head] = self._recv(p, f"computing worker {head}")
            self._queued[p].pop(0)
        return self._done.pop(w)

    def state_dict(self) -> list[dict[str, Any]]:
        for p in range(self.procs):
            if self._failed[p] is not None:
                raise WorkerDied(self._failed[p])
        if any(self._queued):
            raise RuntimeError("ProcessPool.state_dict with jobs in flight; collect their results first")
        states: list[Any] = [None] * self.num_workers
        for p in range(self.procs):
            self._send(p, ("state", None), "sending its workers' state")
            for w, state in zip(self.members[p], self._recv(p, "sending its workers' state"), strict=True):
                states[w] = state
        return states

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for p in range(self.procs):
            self._send(p, ("load", [states[w] for w in self.members[p]]), "loading its workers' state")
            self._recv(p, "loading its workers' state")

    def _name(self, p: int) -> str:
        ws = self.members[p]
        return f"worker process {p} ({'worker' if len(ws) == 1 else 'workers'} {', '.join(map(str, ws))})"

    def _fail(self, p: int, what: str) -> WorkerDied:
        """Record process p as gone; the error that says so (raised again by later calls)."""
        if self._failed[p] is None:
            self._failed[p] = f"{self._name(p)} {what}; {RESUME_OR}start the run again"
        return WorkerDied(self._failed[p])

    def _died(self, p: int, doing: str) -> WorkerDied:
        proc = self._procs[p]
        proc.join(timeout=5)  # a process whose pipe broke is exiting: wait for its exit code
        return self._fail(p, f"{_exit_text(proc.exitcode)} while {doing}")

    def _send(self, p: int, message: tuple, doing: str) -> None:
        if self._failed[p] is not None:
            raise WorkerDied(self._failed[p])
        if self._senders[p].error is not None:  # BrokenPipeError, ConnectionResetError: it is gone
            raise self._died(p, doing)
        self._senders[p].send(message)

    def _recv(self, p: int, doing: str) -> Any:
        """The next reply of process p. Waits as long as the process lives (jobs can be long);
        a dead process, or an error it sends back, is a WorkerDied."""
        if self._failed[p] is not None:
            raise WorkerDied(self._failed[p])
        conn, proc = self._conns[p], self._procs[p]
        try:
            while not conn.poll(self.poll_s):
                # A dead process's pipe normally reads as closed at once; this catches one that
                # stays open (its end inherited elsewhere). A reply sent just before death wins.
                if not proc.is_alive() and not conn.poll(0):
                    raise self._died(p, doing)
            status, value = _read(conn)
        except (OSError, EOFError):
            raise self._died(p, doing) from None
        if status == "error":
            proc.join(timeout=5)
            raise self._fail(p, f"failed: {value} (its traceback is above)")
        return value

    def close(self) -> None:
        """Stop every process; never hangs or raises, even on dead ones. A process still
        computing jobs nobody collected is killed rather than waited for."""
        for p, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True)):
            sender = self._senders[p]
            if self._failed[p] is None and not self._queued[p]:
                sender.send(("close", None))
                sender.close()
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
            sender.close(timeout=0)
            try:
                conn.close()
            except OSError:
                pass
