"""Synchronous DiLoCo over torch.distributed: one process per rank, launched by torchrun.

Each DiLoCo worker is a group of `procs_per_worker` (M) ranks doing ordinary data parallel
(DistributedDataParallel) on that worker's shard; only those M ranks talk every inner step.
Every H steps the outer_grads are averaged across workers by the *group leaders* (local rank 0
of each worker) in buckets of at most `bucket_mb`, then broadcast inside each worker group, and
every rank applies the same outer step with outer.py, so every rank holds the same global
parameters, which a cheap hash checks every round.

Why leaders + broadcast rather than an all-reduce among ranks of equal local index: both give
the same result, but the leaders' way sends one model-sized message per worker across the slow
links between workers instead of M, and the broadcast stays on the fast links inside a worker.

    torchrun --standalone --nproc-per-node 2 -m diloco train --runtime collective --out runs/c2
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco.config import TrainConfig
from diloco.errors import ReplicaMismatch, UserError
from diloco.outer import build_outer_opt, kept_weights
from diloco.runtime.sim import RoundStats
from diloco.schedule import outer_grad_dropped


def param_hash(params: list[torch.Tensor]) -> int:
    """Exact, order-sensitive fingerprint of float32 parameters: their bits summed with
    position weights, in int64. Any changed bit changes it (but for rare collisions)."""
    total = torch.zeros((), dtype=torch.int64)
    for i, p in enumerate(params):
        bits = p.detach().cpu().contiguous().view(torch.int32).flatten().to(torch.int64)
        total += (bits * (torch.arange(bits.numel()) % 7919 + 1)).sum() * (i + 1)
    return int(total)


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local world size) as torchrun sets them."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "--runtime collective runs under torchrun; launch it as "
            "'torchrun --standalone --nproc-per-node 2 -m diloco train --runtime collective ...'."
        )
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


class _Slice:
    """This rank's rows of its worker's batch: the worker batch is M × B rows, rank j takes
    rows [jB, (j+1)B), so M ranks together compute the gradient of the whole worker batch."""

    def __init__(self, batches, local: int, per_rank: int):
        self.batches, self.local, self.per_rank = batches, local, per_rank

    def __iter__(self):
        return self

    def __next__(self):
        lo, hi = self.local * self.per_rank, (self.local + 1) * self.per_rank
        return tuple(t[lo:hi] for t in next(self.batches))

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)


class _ToDevice:
    """Batches moved to this rank's device (the data is sampled on the CPU)."""

    def __init__(self, batches, device: torch.device):
        self.batches, self.device = batches, device

    def __iter__(self):
        return self

    def __next__(self):
        return tuple(t.to(self.device, non_blocking=True) for t in next(self.batches))

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)


def _device() -> torch.device:
    """This rank's device: its GPU (by LOCAL_RANK) if it has one, else the CPU. Ranks of one job
    may differ; the outer sync always runs on CPU tensors over gloo."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


class _KillAt:
    """Fault injection for tests: SIGKILL this process when its n-th batch is asked for."""

    def __init__(self, inner, n: int):
        self.inner, self.n = inner, n

    def __next__(self):
        self.n -= 1
        if self.n < 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return next(self.inner)


def _fault(kind: str, rank: int, round_: int) -> int | None:
    """DILOCO_FAULT='kill:RANK:ROUND:STEP' or 'perturb:RANK:ROUND' (tests only; kill fires on
    the first attempt only, so a restarted job runs through)."""
    spec = os.environ.get("DILOCO_FAULT", "").split(":")
    if len(spec) < 3 or spec[0] != kind or int(spec[1]) != rank or int(spec[2]) != round_:
        return None
    if kind == "kill" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    return int(spec[3]) if len(spec) > 3 else 0


class CollectiveDiLoCo:
    """One rank's share of sync DiLoCo; the same interface as the simulator's DiLoCo where the
    training loop needs it (round, state_dict, model, counters). Rank 0 is `is_main`."""

    def __init__(self, cfg: TrainConfig, shards: list[torch.Tensor], weights: list[float], *, build_worker):
        self.rank, self.world, _ = world_from_env()
        M = cfg.procs_per_worker
        self.k, self.M = self.world // M, M
        self.worker_id, self.local = self.rank // M, self.rank % M
        self.is_main = self.rank == 0
        self.cfg, self.weights = cfg, weights
        # Every rank creates every group, in the same order (a torch.distributed requirement).
        self.worker_groups = (
            [dist.new_group(list(range(w * M, (w + 1) * M))) for w in range(self.k)] if M > 1 else []
        )
        self.leaders = dist.new_group([w * M for w in range(self.k)]) if M > 1 else dist.group.WORLD
        # Which ranks have a GPU: a worker whose ranks all do uses NCCL for its data parallel.
        flags = [torch.zeros(1) for _ in range(self.world)]
        dist.all_gather(flags, torch.ones(1) if _device().type == "cuda" else torch.zeros(1))
        self.cuda_workers = [all(flags[w * M + j].item() for j in range(M)) for w in range(self.k)]
        self.nccl_groups = [
            dist.new_group(list(range(w * M, (w + 1) * M)), backend="nccl")
            if M > 1 and self.cuda_workers[w]
            else None
            for w in range(self.k)
        ]
        torch.manual_seed(cfg.seed)
        from diloco.model import GPT

        self.model = GPT(cfg.model)  # the global parameters: the same on every rank by construction
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        worker = build_worker(self.worker_id, cfg, shards, batch_multiple=M)
        self.device = _device()
        if M > 1:
            worker.batches = _Slice(worker.batches, self.local, cfg.data.batch_size)
        if self.device.type != "cpu":
            worker.model.to(self.device)  # before the optimizer's first step, so its state follows
            worker.batches = _ToDevice(worker.batches, self.device)
        if M > 1:
            worker.model = DistributedDataParallel(
                worker.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                process_group=self._ddp_group(),
            )
        self.worker = worker
        self.outer_opt = build_outer_opt(cfg.outer)
        self.version = self.rounds_done = self.inner_step = self.total_steps = 0
        self.own_start = False
        self.sim_time_s = None  # real processes: wall time only
        self.bytes_sent = [0] * self.k  # per worker (its leader's traffic), known on every rank
        self.bytes_received = [0] * self.k
        self.rank_bytes = [0, 0]  # this rank's own (sent, received)
        self.bytes_per_rank = [[0, 0] for _ in range(self.world)]  # every rank's, cumulative
        self.timing = {"compute_s": 0.0, "comm_s": 0.0}
        self._check_replicas(-1)

    @property
    def num_workers(self) -> int:
        return self.k

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

    def _allreduce_buckets(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum `grads` over the leaders in flat buckets of at most bucket_mb, then broadcast the
        sums inside each worker group. Returns the summed tensors (CPU, float32)."""
        flat = torch.cat([g.detach().reshape(-1).float().cpu() for g in grads])
        per_bucket = max(1, int(self.cfg.bucket_mb * 1e6) // 4)
        for lo in range(0, flat.numel(), per_bucket):
            bucket = flat[lo : lo + per_bucket]
            nbytes = bucket.numel() * 4
            if self.local == 0:
                dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self.leaders)
                self.rank_bytes[0] += nbytes
                self.rank_bytes[1] += nbytes
            if self.M > 1:
                dist.broadcast(bucket, src=self.worker_id * self.M, group=self.worker_groups[self.worker_id])
                self.rank_bytes[0 if self.local == 0 else 1] += nbytes
        out, offset = [], 0
        for g in grads:
            out.append(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return out

    def round(self, *, active: int | None = None) -> RoundStats:
        n, H = active or self.k, self.cfg.inner_steps
        w = self.worker_id
        t0 = time.perf_counter()
        loss, lr = float("nan"), 0.0
        contribution = [torch.zeros_like(p) for p in self.params]
        dropped = [
            outer_grad_dropped(self.cfg.seed, self.rounds_done, i, self.cfg.drop_prob) for i in range(n)
        ]
        if w >= n:  # an inactive worker rejoins from the global parameters
            self.own_start = False
        if w < n:
            kill = _fault("kill", self.rank, self.rounds_done + 1)
            if kill is not None:
                self.worker.batches = _KillAt(self.worker.batches, kill)
            result = self.worker.run(None if self.own_start else self.params, H)
            loss, lr = result.mean_loss, result.last_lr
            if not dropped[w]:
                kept = [not d for d in dropped]
                weight = kept_weights(self.weights, kept)[sum(kept[:w])]
                contribution = [torch.zeros_like(g).add_(g, alpha=weight) for g in result.outer_grad]
            self.own_start = dropped[w]
        compute_s = time.perf_counter() - t0
        before = list(self.rank_bytes)
        averaged = self._allreduce_buckets(contribution)
        if not all(dropped):
            self.outer_opt.step(self.params, averaged)
            self.version += 1
        if _fault("perturb", self.rank, self.rounds_done + 1) is not None:
            with torch.no_grad():
                self.params[0].view(-1)[0] += 1e-3
        self.rounds_done += 1
        self.inner_step += H
        self.total_steps += n * H
        comm_s = time.perf_counter() - t0 - compute_s
        self._check_replicas(self.rounds_done - 1)
        # Everyone learns every worker's loss and traffic (a few numbers per rank).
        mine = torch.tensor(
            [loss, lr, compute_s, comm_s, self.rank_bytes[0] - before[0], self.rank_bytes[1] - before[1]],
            dtype=torch.float64,
        )
        every = [torch.zeros(6, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(every, mine)
        leaders = [every[i * self.M] for i in range(self.k)]
        for i, row in enumerate(leaders):
            self.bytes_sent[i] += int(row[4])
            self.bytes_received[i] += int(row[5])
        for r, row in enumerate(every):
            self.bytes_per_rank[r][0] += int(row[4])
            self.bytes_per_rank[r][1] += int(row[5])
        self.timing = {
            "compute_s": max(float(r[2]) for r in every),
            "comm_s": max(float(r[3]) for r in every),
        }
        return RoundStats(
            self.version,
            self.inner_step,
            [float(r[0]) for r in leaders[:n]],
            float(leaders[0][1]),
            list(self.bytes_sent),
            list(self.bytes_received),
        )

    # -- checkpoints: rank 0 holds the whole state, like the simulator's DiLoCo.state_dict ------
    def _common(self) -> dict[str, Any]:
        return {
            "global": self.model.state_dict(),
            "outer_opt": self.outer_opt.state_dict(),
            "version": self.version,
            "rounds_done": self.rounds_done,
            "total_steps": self.total_steps,
            "inner_step": self.inner_step,
            "bytes_sent": list(self.bytes_sent),
            "bytes_received": list(self.bytes_received),
            "bytes_per_rank": [list(b) for b in self.bytes_per_rank],
        }

    def _worker_state(self) -> dict[str, Any]:
        state = self.worker.state_dict()
        if self.M > 1:  # DDP prefixes parameter names with "module."
            state["model"] = self.worker.model.module.state_dict()
        return {**state, "own_start": self.own_start}

    def state_dict(self) -> dict[str, Any] | None:
        gathered = [None] * self.world if self.is_main else None
        dist.gather_object(self._worker_state() if self.local == 0 else None, gathered, dst=0)
        if not self.is_main:
            return None
        return {**self._common(), "workers": [gathered[w * self.M] for w in range(self.k)]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        parts = None
        if self.is_main:
            common = {k: v for k, v in state.items() if k != "workers"}
            parts = [{**common, "worker": state["workers"][r // self.M]} for r in range(self.world)]
        received = [None]
        dist.scatter_object_list(received, parts, src=0)
        mine = received[0]
        self.model.load_state_dict(mine["global"])
        self.outer_opt.load_state_dict(mine["outer_opt"])
        for key in ("version", "rounds_done", "total_steps", "inner_step"):
            setattr(self, key, int(mine[key]))
        self.bytes_sent = [int(b) for b in mine["bytes_sent"]]
        self.bytes_received = [int(b) for b in mine["bytes_received"]]
        self.bytes_per_rank = [[int(x) for x in b] for b in mine["bytes_per_rank"]]
        worker = dict(mine["worker"])
        self.own_start = bool(worker.pop("own_start"))
        target = self.worker.model.module if self.M > 1 else self.worker.model
        target.load_state_dict(worker.pop("model"))
        self.worker.optimizer.load_state_dict(worker["optimizer"])
        self.worker.step = int(worker["step"])
        self.worker.batches.load_state_dict(worker["batches"])

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
                dist.barrier()
            dist.destroy_process_group()


def broadcast_object(box: list) -> None:
    """Rank 0's box[0] to every rank, in place (before any CollectiveDiLoCo exists)."""
    dist.broadcast_object_list(box, src=0)


def threads_per_rank(cfg: TrainConfig) -> int:
    """--threads, or this machine's cores shared evenly by its ranks (one each on 2 cores)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return cfg.threads or max(1, len(os.sched_getaffinity(0)) // local_world)


def init(cfg: TrainConfig) -> None:
    """Join the job torchrun started: gloo for CPU tensors (the outer sync always uses it)."""
    _, world, _ = world_from_env()
    if world % cfg.procs_per_worker:
        raise UserError(
            f"torchrun started {world} ranks, which --procs-per-worker {cfg.procs_per_worker} does not "
            "divide; start a multiple of it."
        )
    if cfg.num_workers != world // cfg.procs_per_worker:
        raise UserError(
            f"--workers {cfg.num_workers} does not match {world} ranks with --procs-per-worker "
            f"{cfg.procs_per_worker} ({world // cfg.procs_per_worker} workers); drop --workers or fix it."
        )
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=_store(), rank=int(os.environ["RANK"]), world_size=world)


def _store() -> dist.Store:
    """torchrun's store, with keys prefixed by the restart attempt: torchrun's agent keeps its
    store across restarts, and without a prefix a restarted rank can read the dead attempt's
    addresses and fail to connect ("Gloo connectFullMesh failed ... Connection refused")."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent and int(os.environ["RANK"]) == 0,
        timeout=timedelta(minutes=30),
        multi_tenant=not agent,
    )
    return dist.PrefixStore(f"diloco/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
