"""Synchronous DiLoCo over torch.distributed: one process per rank, launched by torchrun.

Each DiLoCo worker is a group of `procs_per_worker` (M) ranks doing ordinary data parallel
(DistributedDataParallel) on that worker's shard; only those M ranks talk every inner step.
Every H steps the outer_grads are averaged across workers by the *group leaders* (local rank 0
of each worker) in buckets of at most `bucket_mb`, then broadcast inside each worker group, and
every rank's outer side (outer_side.py) applies the same step, so every rank holds the same
global parameters, which a cheap hash checks every round.

Why leaders + broadcast rather than an all-reduce among ranks of equal local index: both give
the same result, but the leaders' way sends one model-sized message per worker across the slow
links between workers instead of M, and the broadcast stays on the fast links inside a worker.

    torchrun --standalone --nproc-per-node 2 -m diloco train --runtime collective --out runs/c2
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from diloco.config import TrainConfig
from diloco.config.parsers import parse_slowdown
from diloco.core.async_policy import DEADLINE_CAP
from diloco.core.codec import Encoded
from diloco.core.dylu import RoundPlanner
from diloco.core.inner import Worker
from diloco.core.outer_side import OuterSide
from diloco.core.streaming import Schedule
from diloco.errors import RESUME_OR, ReplicaMismatch, RunFailed, WorkerDied
from diloco.runtime import RoundStats, faults, is_main_process
from diloco.runtime.clock import Clock, slowed
from diloco.runtime.collective_streaming import StreamingRounds, unflatten
from diloco.runtime.torchrun import data_parallel_rank, world_from_env


def param_hash(params: list[torch.Tensor]) -> int:
    """Exact, order-sensitive fingerprint of float32 parameters: their bits summed with
    position weights, in int64. Any changed bit changes it (but for rare collisions)."""
    total = torch.zeros((), dtype=torch.int64)
    for i, p in enumerate(params):
        bits = p.detach().cpu().contiguous().view(torch.int32).flatten().to(torch.int64)
        total += (bits * (torch.arange(bits.numel()) % 7919 + 1)).sum() * (i + 1)
    return int(total)


def sum_in_buckets(
    tensors: list[torch.Tensor], bucket_mb: float, reduce: Callable[[torch.Tensor], None]
) -> list[torch.Tensor]:
    """`tensors` summed across ranks: flattened on the CPU and handed to `reduce`, which sums
    its argument in place, in buckets of at most `bucket_mb` megabytes (so a large model never
    needs a second model-sized buffer per collective)."""
    flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors])
    per_bucket = max(1, int(bucket_mb * 1e6) // flat.element_size())
    for lo in range(0, flat.numel(), per_bucket):
        reduce(flat[lo : lo + per_bucket])
    return unflatten(flat, tensors)


def _device() -> torch.device:
    """This rank's device: its GPU (by LOCAL_RANK) if it has one, else the CPU. Ranks of one job
    may differ; the outer sync always runs on CPU tensors over gloo."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


class CollectiveDiLoCo(StreamingRounds):
    """One rank's share of sync DiLoCo, with the runtime interface of runtime/__init__.py.
    Rank 0 is `is_main`; every rank holds the whole outer side. The run's assembler
    (run/assemble.py) gives it the `side` (the same on every rank), `build_worker(w,
    batch_multiple=M)` for this rank's worker, and Streaming DiLoCo's `schedule` (None: plain)."""

    def __init__(
        self,
        cfg: TrainConfig,
        side: OuterSide,
        *,
        build_worker: Callable[..., Worker],
        schedule: Schedule | None = None,
        planner: RoundPlanner | None = None,
    ):
        self.rank, self.world, _ = world_from_env()
        self.planner = planner  # sync DiLoCo with DyLU (core/dylu.py): the same on every rank
        M = cfg.procs_per_worker
        self.k, self.M = self.world // M, M
        self.worker_id, self.local = self.rank // M, self.rank % M
        self.is_main = is_main_process(cfg)
        self.cfg = cfg
        # Every rank creates every group, in the same order (a torch.distributed requirement), all
        # bounded by --timeout-s but the one for leaving: ranks wait there while rank 0 evaluates
        # the whole validation split and writes the run's last files.
        timeout = timedelta(seconds=cfg.timeout_s)
        self.worker_groups = (
            [dist.new_group(list(range(w * M, (w + 1) * M)), timeout=timeout) for w in range(self.k)]
            if M > 1
            else []
        )
        self.leaders = (
            dist.new_group([w * M for w in range(self.k)], timeout=timeout) if M > 1 else dist.group.WORLD
        )
        self._exit_group = dist.new_group(timeout=max(timeout, timedelta(hours=6)))
        # Which ranks have a GPU: a worker whose ranks all do uses NCCL for its data parallel.
        flags = [torch.zeros(1) for _ in range(self.world)]
        dist.all_gather(flags, torch.ones(1) if _device().type == "cuda" else torch.zeros(1))
        self.cuda_workers = [all(flags[w * M + j].item() for j in range(M)) for w in range(self.k)]
        self.nccl_groups = [
            dist.new_group(list(range(w * M, (w + 1) * M)), backend="nccl", timeout=timeout)
            if M > 1 and self.cuda_workers[w]
            else None
            for w in range(self.k)
        ]
        worker = build_worker(self.worker_id, batch_multiple=M)
        self.device = _device()
        group = self._ddp_group() if M > 1 else None
        data_parallel_rank(
            worker, local=self.local, ranks=M, per_rank=cfg.data.batch_size, device=self.device, group=group
        )
        self.worker = worker
        self.started = time.perf_counter()  # --slowdown's START and END count from here
        # an emulated device: every inner step padded to at least --speeds' seconds, × --slowdown's
        floor_s = cfg.sim.speeds[self.worker_id] if cfg.sim.speeds else 0.0
        clock = Clock([0.0] * self.k, slowdowns=tuple(map(parse_slowdown, cfg.sim.slowdowns)))
        if floor_s or any(s.worker == self.worker_id for s in clock.slowdowns):
            since = self.started
            slowed(
                worker,
                lambda t: max(t, floor_s) * clock.slowdown(self.worker_id, time.perf_counter() - since),
            )
        # Every rank keeps the whole outer side (the same on every rank by construction: seed, or
        # --init-from) and applies the same summed update.
        self.side = side
        faults.wrap_side(self.side, self.rank)
        self.params = self.side.params
        self._setup_streaming(schedule)
        self.rank_bytes = [0, 0]  # this rank's own payload bytes (sent, received)
        self.bytes_per_rank = [[0, 0] for _ in range(self.world)]  # every rank's, cumulative
        with self._collective("the first replica check"):
            self._check_replicas(-1)

    @property
    def sim_time_s(self) -> None:  # real processes: wall time only
        return None

    @property
    def num_workers(self) -> int:
        return self.k

    model = property(lambda self: self.side.model)

    def _ddp_group(self):
        """The worker's own group: NCCL when all its ranks have GPUs, else gloo."""
        return self.nccl_groups[self.worker_id] or self.worker_groups[self.worker_id]

    def _check_replicas(self, round_: int) -> None:
        mine = torch.tensor([param_hash(self.params)], dtype=torch.int64)
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(every, mine)
        bad = [r for r, h in enumerate(every) if h.item() != every[0].item()]
        if bad:
            raise ReplicaMismatch(
                f"global parameters of rank {bad[0]} differ from rank 0's after round {round_ + 1} "
                f"(hash {every[bad[0]].item()} != {every[0].item()}); the ranks diverged, stop and "
                "restart from the last checkpoint."
            )

    def _allreduce_buckets(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum `tensors` over the leaders in flat buckets of at most bucket_mb, then broadcast
        the sums inside each worker group. Returns the summed tensors (CPU)."""

        def reduce(bucket: torch.Tensor) -> None:
            nbytes = bucket.numel() * bucket.element_size()
            if self.local == 0:
                dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self.leaders)
                self.rank_bytes[0] += nbytes
                self.rank_bytes[1] += nbytes
            self._share_in_worker(bucket, nbytes)

        return sum_in_buckets(tensors, self.cfg.bucket_mb, reduce)

    def _share_in_worker(self, tensor: torch.Tensor, nbytes: int) -> None:
        if self.M > 1:
            dist.broadcast(tensor, src=self.worker_id * self.M, group=self.worker_groups[self.worker_id])
            self.rank_bytes[0 if self.local == 0 else 1] += nbytes

    def _gather_messages(self, message: Encoded | None, n: int) -> list[Encoded | None]:
        """Every worker's message, as bytes, to every rank (codecs whose messages cannot be
        summed); the outer side then reduces them in worker order, as the simulator does."""
        blob = message.to_bytes() if message is not None and self.local == 0 else b""
        gathered: list[Any] = [None] * self.k
        if self.local == 0:
            dist.all_gather_object(gathered, blob, group=self.leaders)
            self.rank_bytes[0] += len(blob)
            self.rank_bytes[1] += sum(len(b) for b in gathered)
        if self.M > 1:
            box = [gathered]
            dist.broadcast_object_list(
                box, src=self.worker_id * self.M, group=self.worker_groups[self.worker_id]
            )
            gathered = box[0]
        return [Encoded.from_bytes(b) if b else None for b in gathered[:n]]

    def round(self, *, active: int | None = None) -> RoundStats:
        if self.schedule is not None:
            return self._streaming_round()
        side, H, w, planner = self.side, self.cfg.inner_steps, self.worker_id, self.planner
        t0 = time.perf_counter()
        plan = planner.plan() if planner is not None else None
        starts = side.begin_round(active, steps=plan.steps if plan else None)
        n = len(starts)
        loss, lr, message, finite, taken = float("nan"), 0.0, None, True, 0
        if w < n:
            start = side.downloaded() if starts[w] else None
            if plan is None:
                result = self.worker.run(start, H, lr_step=side.inner_step)
            else:  # a deadline: at most DEADLINE_CAP × the steps expected to fit
                steps = plan.steps[w] * (DEADLINE_CAP if plan.seconds is not None else 1)
                job = {"lr_step": plan.lr_step, "lr_stride": plan.lr_strides[w], "seconds": plan.seconds}
                result = self.worker.run(start, steps, **job)
            loss, lr, finite, taken = result.mean_loss, result.last_lr, result.finite, result.steps
            message = result.message
        compute_s = time.perf_counter() - t0
        before = list(self.rank_bytes)
        with self._collective("the outer sync"):
            # Every rank learns each worker's message size, whether it is finite and the steps it
            # took, so every outer side makes the same decisions (drops, weights) before the
            # reduction.
            mine = torch.tensor([message.nbytes if message else 0, int(finite), taken], dtype=torch.int64)
            every = [torch.zeros(3, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(every, mine)
            took = [int(every[i * self.M][2]) for i in range(n)]
            for i in range(n):
                row = every[i * self.M]
                side.report(i, int(row[0]), bool(row[1]), steps=took[i] if plan else None)
            if side.codec.summable:  # zeros from an inactive worker or a dropped outer_grad
                summed = self._allreduce_buckets(side.contribution(w, message))
            else:
                summed = side.reduce(self._gather_messages(message, n))
            side.end_round(summed, H if plan is None else planner.spend(sum(took)))
        comm_s = time.perf_counter() - t0 - compute_s
        stats = self._finish_round(loss, lr, compute_s, comm_s, before, n)
        if plan is not None:  # every rank records the same measured times: the same next plan
            for i in range(n):
                planner.record(i, self._compute_by_worker[i], took[i])
            stats.steps = took
        return stats

    def _finish_round(
        self, loss: float, lr: float, compute_s: float, comm_s: float, before: list[int], n: int
    ) -> RoundStats:
        """Check the replicas, then let every rank learn every worker's loss, time and traffic."""
        side = self.side
        with self._collective("the replica check"):
            self._check_replicas(side.rounds_done - 1)
            # Everyone learns every worker's loss and traffic (a few numbers per rank).
            mine = torch.tensor(
                [loss, lr, compute_s, comm_s, self.rank_bytes[0] - before[0], self.rank_bytes[1] - before[1]],
                dtype=torch.float64,
            )
            every = [torch.zeros(6, dtype=torch.float64) for _ in range(self.world)]
            dist.all_gather(every, mine)
        leaders = [every[i * self.M] for i in range(self.k)]
        self._compute_by_worker = [float(r[2]) for r in leaders]  # a worker's: its leader's
        for r, row in enumerate(every):
            self.bytes_per_rank[r][0] += int(row[4])
            self.bytes_per_rank[r][1] += int(row[5])
        # as on the server: the workers' mean compute, and the rest of the round's wall time
        compute_s = sum(float(r[2]) for r in leaders) / self.k
        wall_s = max(float(r[2]) + float(r[3]) for r in every)
        timing = {"compute_s": compute_s, "comm_s": max(0.0, wall_s - compute_s)}
        return RoundStats(
            side.version,
            side.inner_step,
            [float(r[0]) for r in leaders[:n]],
            float(leaders[0][1]),
            list(side.bytes_sent),
            list(side.bytes_received),
            timing,
        )

    @contextmanager
    def _collective(self, what: str):
        """Turn a failed or timed-out collective into one sentence (exit code 3)."""
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, RunFailed):
                raise
            cause = (
                f"a rank hung longer than --timeout-s {self.cfg.timeout_s:g}"
                if "timeout" in str(e).lower() or "timed out" in str(e).lower()
                else "another rank stopped (interrupted or died)"
            )
            raise WorkerDied(
                f"rank {self.rank}: {what} failed after round {self.side.rounds_done}: {cause}; "
                f"{RESUME_OR}start the run again."
            ) from None

    def summary_extras(self) -> dict[str, Any]:
        return {"bytes_per_rank": [list(b) for b in self.bytes_per_rank]}

    # -- checkpoints: rank 0 holds the whole state, in the layout every runtime uses -----------
    def _worker_state(self) -> dict[str, Any]:
        state = self.worker.state_dict()
        if self.M > 1:  # DDP prefixes parameter names with "module."
            state["model"] = self.worker.model.module.state_dict()
        return state

    def state_dict(self) -> dict[str, Any] | None:
        gathered = [None] * self.world if self.is_main else None
        with self._collective("gathering the checkpoint"):
            dist.gather_object(self._worker_state() if self.local == 0 else None, gathered, dst=0)
        if not self.is_main:
            return None
        return {
            "outer": self.side.state_dict(),
            "workers": [gathered[w * self.M] for w in range(self.k)],
            "runtime": {"collective": {"bytes_per_rank": [list(b) for b in self.bytes_per_rank]}},
            **({"dylu": self.planner.state_dict()} if self.planner is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        parts = None
        if self.is_main:  # a checkpoint that does not fit is every rank's error, not rank 0's alone
            try:
                if len(state["workers"]) != self.k:
                    raise ValueError(f"the checkpoint has {len(state['workers'])} workers, this job {self.k}")
                mine = state.get("runtime", {}).get("collective", {})
                per_rank = mine.get("bytes_per_rank")
                per_rank = per_rank if per_rank is not None and len(per_rank) == self.world else None
                parts = [
                    {
                        "outer": state["outer"],
                        "worker": state["workers"][r // self.M],
                        "bytes_per_rank": per_rank,
                        "dylu": state.get("dylu"),
                    }
                    for r in range(self.world)
                ]
            except (KeyError, ValueError, TypeError, IndexError) as e:
                parts = [{"error": f"{type(e).__name__}: {e}"}] * self.world
        received = [None]
        with self._collective("sending the checkpoint"):
            dist.scatter_object_list(received, parts, src=0)
        if "error" in received[0]:
            raise ValueError(received[0]["error"])
        mine = received[0]
        self.side.load_state_dict(mine["outer"])
        if self.planner is not None and mine["dylu"] is not None:
            self.planner.load_state_dict(mine["dylu"])
        if mine["bytes_per_rank"] is not None:  # a run from another runtime or size starts at 0
            self.bytes_per_rank = [[int(x) for x in b] for b in mine["bytes_per_rank"]]
        worker = dict(mine["worker"])
        target = self.worker.model.module if self.M > 1 else self.worker.model
        target.load_state_dict(worker.pop("model"))
        self.worker.optimizer.load_state_dict(worker["optimizer"])
        self.worker.step = int(worker["step"])
        self.worker.codec_state = dict(worker.get("codec", {}))
        self.worker.batches.load_state_dict(worker["batches"])
        if self.schedule is not None:
            self._anchored = False  # the worker holds its own θ; the global one is its anchor

    def after_checkpoint(self) -> None:
        pass

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, *, clean: bool = True) -> None:
        """Leave the job. On the normal path all ranks leave together (a rank that tears gloo
        down while rank 0 still writes the summary can abort its peers); after an error this rank
        must not wait for the others, who may be blocked in a collective it will never join."""
        if dist.is_initialized():
            if clean:
                dist.barrier(group=self._exit_group)
            dist.destroy_process_group()
