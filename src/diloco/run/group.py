"""A server worker of several processes: torchrun's ranks doing data parallel inside every job.

    torchrun --standalone --nproc-per-node 4 -m diloco worker --server 10.0.0.5:7000
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29400 \\
        --rdzv-id job1 -m diloco worker --server 10.0.0.5:7000   # one worker of 16 ranks, two nodes

The group is one worker to the server. Rank 0, the leader, is the only one that talks to it: it
registers (saying its ranks and its launch), keeps the lease with its heartbeat, gets each job
and pushes its outer_grad. What it hears, every rank hears (`lead`): a job's header and θ are
broadcast over gloo, and an error, or the run being over, stops every rank with the same
sentence. In a job the ranks take the same inner steps on their rows of the worker's batch,
DistributedDataParallel averaging the gradients every step (runtime.torchrun.data_parallel_rank,
as the collective runtime's --procs-per-worker does); before each step the leader says whether
another starts (a deadline job runs on the leader's clock), so every rank takes the same steps.
Their outer_grads are then identical, which a hash of the message checks, and the leader pushes
it once.

A worker started without torchrun is a group of one, and every call here is a plain call.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from diloco.core.codec import Encoded
from diloco.core.inner import Worker
from diloco.errors import ReplicaMismatch, RunFailed, UserError, WorkerDied
from diloco.run.link import RunOver
from diloco.runtime import torchrun

T = TypeVar("T")
# How long a rank waits for its leader in one call (registering, preparing the data, a job, a
# push), on top of --retry-s: a rank that waits longer than this stops (exit 3).
WAIT_S = 1800.0
GO, STOP, OVER = 1, 0, 2  # the leader's word before each inner step


class Group:
    """The ranks of one server worker (`size` 1: a plain process, no torch.distributed)."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0):
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.leader = rank == 0
        self.torchrun = False  # started by torchrun (which restarts it: `launch`)
        self._nccl = None  # the ranks' NCCL group for DistributedDataParallel on GPUs

    @classmethod
    def from_env(cls, retry_s: float) -> Group:
        """The group torchrun started this process in, else a group of one."""
        if "WORLD_SIZE" not in os.environ:
            return cls()
        rank, world, _ = torchrun.world_from_env()
        torchrun.join(timedelta(seconds=WAIT_S + retry_s))
        group = cls(rank, world, int(os.environ.get("LOCAL_RANK", "0")))
        group.torchrun = True
        return group

    @property
    def launch(self) -> str:
        """The torchrun launch, the same in its restarts ("" without torchrun)."""
        return (torchrun.launch_id() or "") if self.torchrun else ""

    def lead(self, fn: Callable[[], T]) -> T:
        """`fn` on the leader; every rank returns its value, or raises its UserError or RunOver."""
        if self.size == 1:
            return fn()
        box: list[Any] = [None]
        failure = None
        if self.leader:
            try:
                box[0] = ("ok", fn())
            except (UserError, RunOver) as e:
                box[0] = ("raise", e)
            except Exception as e:  # an internal error: the leader shows it, the others a sentence
                box[0], failure = ("failed", type(e).__name__), e
        with self._collective("waiting for the leader"):
            dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if failure is not None:
            raise failure
        if kind == "raise":
            raise value
        if kind == "failed":
            raise RunFailed(
                f"rank {self.rank}: the worker's leader (rank 0) failed ({value}); see its output."
            )
        return value

    def first(self, fn: Callable[[], T]) -> T:
        """`fn` on the leader, then on the others (work that fills caches on disk, once)."""
        mine: list[T] = []
        self.lead(lambda: mine.append(fn()))
        return mine[0] if self.leader else fn()

    def share(self, blob: bytes | None, nbytes: int) -> bytes:
        """The leader's `blob` of `nbytes` bytes (θ as the server sent it), on every rank."""
        if self.size == 1 or nbytes == 0:
            return blob or b""
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if self.leader else None
        buf = buf if buf is not None else torch.empty(nbytes, dtype=torch.uint8)
        with self._collective("receiving the job's parameters"):
            dist.broadcast(buf, src=0)
        return buf.numpy().tobytes()

    def place(self, worker: Worker, device: torch.device, rows: int) -> None:
        """This rank's part of `worker`, whose batches are `rows` rows: its share of them, on
        `device`, its gradients averaged over the group at every step."""
        group = None
        if self.size > 1 and device.type == "cuda":
            self._nccl = self._nccl or dist.new_group(backend="nccl")
            group = self._nccl
        torchrun.data_parallel_rank(
            worker, local=self.rank, ranks=self.size, per_rank=rows // self.size, device=device, group=group
        )

    def device(self, name: str) -> str:
        """A rank's device: `cuda` means this node's GPU of the rank's local index."""
        if self.size > 1 and name == "cuda" and torch.cuda.is_available():
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"
        return name

    def steps_together(self, worker: Worker, over: threading.Event) -> None:
        """Before each inner step the leader decides (a deadline on its clock; RunOver once
        `over` is set, as the heartbeat hears the run is over) and every rank follows."""
        own = worker.may_step
        word = torch.zeros(1, dtype=torch.int64)

        def may_step(done: int, spent_s: float, seconds: float | None) -> bool:
            if self.leader:
                word[0] = OVER if over.is_set() else GO if own(done, spent_s, seconds) else STOP
            if self.size > 1:
                with self._collective("an inner step"):
                    dist.broadcast(word, src=0)
            if word.item() == OVER:
                raise RunOver
            return word.item() == GO

        worker.may_step = may_step

    def check_same(self, message: Encoded, job: int) -> None:
        """Every rank's outer_grad message for `job` is the leader's (by a hash of its tensors: a
        safetensors header's order may differ between processes)."""
        if self.size == 1:
            return
        mine = int.from_bytes(bytes.fromhex(message.digest())[:8], "little", signed=True)
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        with self._collective("checking the outer_grad"):
            dist.all_gather(every, torch.tensor([mine], dtype=torch.int64))
        bad = [r for r, h in enumerate(every) if h.item() != every[0].item()]
        if bad:
            raise ReplicaMismatch(
                f"rank {bad[0]} of this worker computed another outer_grad than rank 0 for job {job}; the "
                "ranks diverged (run them on alike devices): the job is not pushed, start the worker again."
            )

    @contextmanager
    def _collective(self, what: str):
        """A peer that died or hung is one sentence (exit 3), not a gloo traceback."""
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, RunFailed):
                raise
            raise WorkerDied(
                f"rank {self.rank} of this worker: {what} failed: another rank of it stopped or hung; "
                "torchrun restarts the group with --max-restarts, else start it again."
            ) from None

    def close(self) -> None:
        """Leave the process group; after a run that ended well, every rank together (a rank
        whose peer tore gloo's connections down first could abort at exit: SIGABRT,
        "terminate called without an active exception", in test_server_groups.py)."""
        if self.torchrun and dist.is_initialized():
            if self.size > 1 and sys.exc_info()[0] is None:
                try:
                    dist.monitored_barrier(timeout=timedelta(seconds=30))
                except (RuntimeError, dist.DistError):
                    pass  # a peer that is gone leaves all the same
            dist.destroy_process_group()
