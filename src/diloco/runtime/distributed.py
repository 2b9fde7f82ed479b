"""Sync DiLoCo in your own training loop, across real processes (torchrun, torch.distributed).

Each process is one DiLoCo worker (or each M processes, with `procs_per_worker`). You keep your
model, your inner optimizer and your loop; call `step()` after each inner optimizer step, and
every `inner_steps` calls it runs the outer step: every worker's outer_grad θ_global − θ_local
goes through the codec, the messages are averaged across the workers, the outer optimizer
updates θ_global, and your model's parameters become θ_global. The outer side
(core/outer_side.py), the encoding (core/inner.py) and the bucketed all-reduce
(runtime/collective.py) are the ones `diloco train` runs, so with the same model, data and seed
it gives the global parameters the simulator's `DiLoCo` gives (bitwise with two processes;
tested in tests/integration/test_distributed_library.py).

    torchrun --standalone --nproc-per-node 2 train.py     # train.py: README.md's example
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from diloco.core.codec import Codec, Encoded, Fp32Codec
from diloco.core.inner import encode_outer_grad, outer_grad_from
from diloco.core.outer import Fragmented, Nesterov, OuterOpt
from diloco.core.outer_side import OuterSide
from diloco.errors import NonFinite
from diloco.runtime.collective import sum_in_buckets
from diloco.runtime.distributed_checks import _check_arguments, _cpu_copy, _digest, _schedule
from diloco.runtime.distributed_dylu import DyluSteps
from diloco.runtime.distributed_streaming import StreamingSteps


class DistributedDiLoCo(StreamingSteps, DyluSteps):
    """The outer side of sync DiLoCo for one process of a torch.distributed job.

    `model` is this process's model (on any device; the module itself, not wrapped in
    DistributedDataParallel). Each process is one worker, or with `procs_per_worker` M each M
    consecutive processes are one (a machine of M GPUs, say): build this first, then wrap the
    model in DistributedDataParallel over the worker's processes (`worker_group`, gloo; on GPUs
    the group of `torch.distributed.new_subgroups(M, backend="nccl")`, made on every process);
    each process of a worker must hold the whole model, as DDP keeps it, and the worker's first
    process alone encodes and exchanges its outer_grad, then shares the result with the others.
    The trainable parameters are synchronised; the buffers (BatchNorm statistics, say) stay
    local. At construction every process takes rank 0's parameters and buffers, so the workers
    start equal whatever their seeds. θ_global is kept on the CPU of every process (a copy of
    the parameters, plus the outer optimizer's state). `group` is the process group the workers
    talk over (default: the whole job, which `procs_per_worker` > 1 needs); it must move CPU
    tensors (gloo: for a job on NCCL, pass `torch.distributed.new_group(backend="gloo")`, made
    on every process). `codec` encodes each outer_grad (default fp32; e.g. `build_codec("fp4",
    error_feedback=True)`: the error feedback is this worker's, held by its first process).
    `on_nonfinite` "stop" raises `NonFinite` on every process when any worker's outer_grad holds
    a NaN or Inf; "drop" leaves it out of the average and that worker restarts from θ_global
    (`dropped` says so: clear its inner optimizer's state, whose moments may hold NaN).
    `check_global` (default on) compares a fingerprint of θ_global across the processes at each
    sync and raises on every process if any differs (SHA-256, ~0.7 s per GB of parameters on one
    CPU core); turn it off only for a job whose machines may round the outer step differently
    (CPUs of different kinds), where θ_global may then drift apart by rounding.
    `fragments` P > 1 or `overlap_steps` τ > 0 is Streaming DiLoCo (distributed_streaming.py):
    fragment p's outer_grad is sent at its own step of the round and merged τ steps later,
    θ ← `mix_alpha`·θ + (1 − mix_alpha)·θ_global (replaced when τ = 0), each fragment with its own
    copy of `outer_opt`; `on_nonfinite` "stop" and `step()` only. `dylu` is sync DiLoCo with
    dynamic local updates (distributed_dylu.py): each worker's steps a round follow its speed,
    timed by `timer` (default time.perf_counter); loop until `version` reaches your rounds, and
    take each inner step's lr at `schedule_step`.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_steps: int,
        *,
        outer_opt: OuterOpt | None = None,
        codec: Codec | None = None,
        group: dist.ProcessGroup | None = None,
        procs_per_worker: int = 1,
        bucket_mb: float = 25.0,
        on_nonfinite: str = "stop",
        check_global: bool = True,
        fragments: int = 1,
        overlap_steps: int = 0,
        mix_alpha: float = 0.5,
        dylu: bool = False,
        timer: Callable[[], float] | None = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDiLoCo needs a torch.distributed job: call "
                "torch.distributed.init_process_group() first (torchrun sets its environment)"
            )
        _check_arguments(model, inner_steps, outer_opt, bucket_mb, on_nonfinite)
        if dist.get_backend(group) == "nccl":
            raise ValueError(
                "DistributedDiLoCo moves CPU tensors, which an NCCL group cannot: pass "
                "group=torch.distributed.new_group(backend='gloo') (on every process), or start the "
                "job with init_process_group('cpu:gloo,cuda:nccl')"
            )
        self.inner_steps, self.group, self.bucket_mb = inner_steps, group, bucket_mb
        self.check_global = check_global
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._setup_workers(procs_per_worker)
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():  # rank 0's parameters and buffers everywhere
            for t in model.state_dict().values():
                value = t.detach().cpu().contiguous()
                dist.broadcast(value, src=self._root, group=group)
                t.copy_(value)
        schedule = _schedule(inner_steps, fragments, overlap_steps, mix_alpha, on_nonfinite)
        if dylu and schedule is not None:
            raise ValueError(
                "dylu and Streaming DiLoCo do not go together: pass dylu or fragments/overlap_steps"
            )
        if schedule is not None:
            outer_opt = Fragmented([copy.deepcopy(outer_opt or Nesterov()) for _ in range(fragments)])
        self.side = OuterSide(
            _cpu_copy(model),
            self.k,
            update=outer_opt if outer_opt is not None else Nesterov(),
            codec=codec or Fp32Codec(),
            on_nonfinite=on_nonfinite,
        )
        self.codec_state: dict[str, Any] = {}  # this worker's codec state (error feedback)
        self.steps_in_round = 0
        self.dropped = False  # this worker's outer_grad was left out of the last sync (non-finite)
        self._setup_schedule(schedule)
        self._setup_dylu(dylu, timer)

    @property
    def global_params(self) -> list[torch.Tensor]:
        """θ_global (CPU): the same on every process."""
        return self.side.params

    version = property(lambda self: self.side.version)  # outer updates applied so far

    @property
    def bytes_sent(self) -> int:
        """This worker's encoded outer_grads so far, in bytes (what the codec makes of them)."""
        return self.side.bytes_sent[self.worker_id]

    def _setup_workers(self, M: int) -> None:
        """Worker `rank // M` is processes w·M … w·M + M − 1 of the group; its first (local 0) is
        its leader, which alone encodes, exchanges with the other leaders and shares the result
        with its worker's processes."""
        if self.rank < 0:
            raise ValueError("this process is not in `group`: every process that calls this must be in it")
        if not isinstance(M, int) or M < 1 or self.world % M:
            raise ValueError(
                f"procs_per_worker must divide the group's {self.world} processes, got {M}: each "
                "worker is that many processes"
            )
        if M > 1 and self.world != dist.get_world_size():
            raise ValueError(
                "procs_per_worker > 1 needs the whole job as its group (it makes groups of its own)"
            )
        world = range(self.world)
        ranks = [dist.get_global_rank(self.group, i) for i in world] if self.group else list(world)
        self.M, self.k = M, self.world // M
        self.worker_id, self.local = self.rank // M, self.rank % M
        self.worker_ranks = ranks[self.worker_id * M : (self.worker_id + 1) * M]  # global ranks
        self._root, self._leader = ranks[0], self.worker_ranks[0]
        self.leaders, self.worker_group = self.group, None
        if M > 1:  # every process makes every group, in the same order (torch.distributed's rule)
            islands = [dist.new_group(ranks[w * M : (w + 1) * M], backend="gloo") for w in range(self.k)]
            self.worker_group = islands[self.worker_id]
            self.leaders = dist.new_group(ranks[::M], backend="gloo")

    def _where(self) -> list[int]:
        return [self.worker_id, self.local, self.k, self.M]

    def step(self) -> bool:
        """Count one inner step; at every `inner_steps`-th (with DyLU: `round_steps`-th), run the
        outer step (every process must call it equally often; with DyLU, as its worker's others).
        Returns whether this call synchronised (with `fragments`: whether it ended a round, every
        fragment merged)."""
        self.steps_in_round += 1
        if self.schedule is not None:
            return self._streaming_step()
        if self.steps_in_round < self.round_steps:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now, on the inner steps taken since the last one (every process must
        call it together; `step()` calls it for you every `inner_steps`, with DyLU every
        `round_steps`). With no inner step since the last one, on every process, it does nothing
        (an outer step on nothing would still move θ_global by the outer momentum); with a
        different number of steps (with DyLU: within a worker), or another θ_global, on some
        process it raises on every process, before anything changes."""
        if self.schedule is not None:
            raise RuntimeError(
                "Streaming DiLoCo (fragments, overlap_steps) syncs each fragment at its own step of the "
                "round: call step() after every inner step, not sync()"
            )
        # one small all-gather: every process's step count, its θ_global's fingerprint (all must
        # hold the same), in a worker of several its parameters' fingerprint, with DyLU its time
        some = self.steps_in_round or self.planner is not None
        worker_digest = self._worker_digest() if some else 0
        global_digest = self._global_digest() if some else -1
        every = self._gather([self.steps_in_round, worker_digest, global_digest, self._elapsed_us()])
        steps = [int(row[0]) for row in every]
        # equal everywhere; with DyLU, equal within each worker
        apart = [steps[w * self.M : (w + 1) * self.M] for w in range(self.k)] if self.planner else [steps]
        if any(len(set(group)) > 1 for group in apart):
            raise RuntimeError(
                "the processes reached the outer sync after different numbers of inner steps "
                f"({', '.join(map(str, steps))} by rank): every process must call "
                "step() (or sync()) equally often" + (" as its worker's others" if self.planner else "")
            )
        if not any(steps):
            self._round_began = self.timer()  # (the time to learn it is no worker's speed)
            return
        self._check_global([int(row[2]) for row in every])
        self._check_worker_replicas([int(row[1]) for row in every])
        side, w = self.side, self.worker_id
        side.begin_round(steps=self._plan.steps if self._plan else None)
        message, finite = None, True
        if self.local == 0:  # a worker's processes hold the same parameters: its leader encodes
            outer_grad, finite = outer_grad_from(side.params, self.params)
            message = encode_outer_grad(side.codec, outer_grad, finite, self.codec_state)
        # every process learns every worker's message size and finiteness: the same decisions
        rows = self._by_worker([message.nbytes if message else 0, int(finite)])
        self.dropped = not bool(rows[w][1])
        took = [int(every[i * self.M][0]) for i in range(self.k)]
        for i, row in enumerate(rows):
            try:
                side.report(i, int(row[0]), bool(row[1]), steps=took[i] if self.planner else None)
            except NonFinite:
                raise NonFinite(
                    f"worker {i}'s outer_grad holds a NaN or Inf after round {side.rounds_done + 1}; "
                    "θ_global is unchanged: lower the inner lr, or pass on_nonfinite='drop'"
                ) from None
        if side.codec.summable:
            summed = sum_in_buckets(side.contribution(w, message), self.bucket_mb, self._all_reduce)
        else:  # messages that cannot be summed: every worker's, reduced in worker order
            box: list[Any] = [[None] * self.k]
            if self.local == 0:
                dist.all_gather_object(box[0], message.to_bytes(), group=self.leaders)
            if self.M > 1:
                dist.broadcast_object_list(box, src=self._leader, group=self.worker_group)
            summed = side.reduce([Encoded.from_bytes(b) for b in box[0]])
        elapsed_us = [int(every[i * self.M][3]) for i in range(self.k)]
        side.end_round(summed, self._dylu_end(took, elapsed_us) if self.planner else self.steps_in_round)
        for p, g in zip(self.params, side.params, strict=True):
            p.copy_(g)
        self.steps_in_round = 0
        self._round_began = self.timer()

    def _gather(self, values: list[int]) -> list[torch.Tensor]:
        mine = torch.tensor(values, dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        return every

    def _worker_digest(self) -> int:
        return _digest(self.params) if self.M > 1 else 0  # a worker's processes must agree

    def _global_digest(self) -> int:
        return _digest(self.side.params) if self.check_global else -1  # -1: not checked

    def _check_global(self, digests: list[int]) -> None:
        """Every process must hold the same θ_global (the outer steps are the same everywhere):
        the first process of the group that differs from the group's first is named (-1: not
        checked, which must then hold on every process)."""
        if -1 in digests:
            if set(digests) != {-1}:
                raise RuntimeError(
                    "check_global is off on some processes and on on others: pass the same on every process"
                )
            return
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if bad:
            raise RuntimeError(
                f"θ_global on rank {bad[0]} differs from rank 0's at outer sync {self.side.rounds_done + 1} "
                f"({len(bad)} of {self.world} processes differ from rank 0, ranks of `group`): the "
                "processes diverged; restart every process from its last state_dict()"
            )

    def _check_worker_replicas(self, digests: list[int]) -> None:
        """Every process of a worker must hold the same parameters: `digests` (every process's,
        from the whole group) tell every process alike, so all raise, or none."""
        for w in range(self.k):
            if len(set(digests[w * self.M : (w + 1) * self.M])) > 1:
                raise RuntimeError(
                    f"the processes of worker {w} hold different parameters at the outer sync: wrap "
                    "the model in DistributedDataParallel over outer.worker_group (each process of a "
                    "worker holds the whole model, the same as the others)"
                )

    def _by_worker(self, values: list[int]) -> list[torch.Tensor]:
        """Each worker's `values`, as its leader gives them, on every process."""
        table = torch.zeros(self.k, len(values), dtype=torch.int64)
        if self.local == 0:
            dist.all_gather(list(table.unbind()), torch.tensor(values, dtype=torch.int64), group=self.leaders)
        if self.M > 1:
            dist.broadcast(table, src=self._leader, group=self.worker_group)
        return list(table)

    def _all_reduce(self, bucket: torch.Tensor) -> None:
        """Sum a bucket over the leaders, then give it to every process of the worker."""
        if self.local == 0:
            dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self.leaders)
        if self.M > 1:
            dist.broadcast(bucket, src=self._leader, group=self.worker_group)

    def state_dict(self) -> dict[str, Any]:
        """This worker's outer state, to checkpoint on every process beside its model and inner
        optimizer (mid-round they differ by process, and so does the error feedback): θ_global,
        the outer optimizer, the codec state and the place in the round."""
        self._refuse_in_flight("state_dict()")
        return {
            "outer": self.side.state_dict(),
            "codec": dict(self.codec_state),
            "steps_in_round": self.steps_in_round,
            "where": self._where(),  # [worker, process in the worker, workers, processes a worker]
            "streaming": self._schedule_key(),  # [fragments, overlap_steps, α], None: plain DiLoCo
            "dylu": self._dylu_state(),  # its planner (spent steps, measured speeds), None: without
            "round_elapsed_s": self.timer() - self._round_began,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this process's own `state_dict()` (after construction, whose broadcast would
        overwrite a model loaded before it). Every process must call it together: before
        anything changes it checks that each process has its own worker's checkpoint and that
        all of them are of the same round, θ_global (unless `check_global` is off) and Streaming
        DiLoCo schedule as this one, and raises on every process if not."""
        self._refuse_in_flight("load_state_dict()")
        where = [int(x) for x in state.get("where", self._where())]
        outer = state["outer"]
        other_schedule = state.get("streaming") != self._schedule_key() or (state.get("dylu") is None) != (
            self.planner is None
        )
        mine = [where != self._where(), outer["version"], state["steps_in_round"], other_schedule]
        digest = _digest(list(outer["global"].values())) if self.check_global else -1
        every = [row.tolist() for row in self._gather([*map(int, mine), digest])]
        if self.planner is not None:  # mid-round, workers of different speeds hold different counts
            for w in range(self.k):
                if len({row[2] for row in every[w * self.M : (w + 1) * self.M]}) == 1:
                    for row in every[w * self.M : (w + 1) * self.M]:
                        row[2] = 0
        if where != self._where():
            w, i, k, M = where
            raise ValueError(
                f"this checkpoint is process {i} of worker {w} (of {k} workers of {M}), this process "
                f"is process {self.local} of worker {self.worker_id} (of {self.k} of {self.M}): give "
                "each process the state_dict() it saved itself"
            )
        if any(int(row[0]) for row in every):
            raise ValueError("another process was given a checkpoint of another process; nothing was loaded")
        if any(int(row[3]) for row in every):
            raise ValueError(self._other_schedule(state.get("streaming"), state.get("dylu") is not None))
        if -1 in (digests := {row[4] for row in every}) and digests != {-1}:
            raise ValueError(
                "check_global is off on some processes and on on others: pass the same on every process"
            )
        if len({tuple(row) for row in every}) > 1:
            raise ValueError(
                "the processes were given checkpoints of different rounds or θ_global: give each "
                "process the state_dict() it saved itself, all from the same step; nothing was loaded"
            )
        self.side.load_state_dict(outer)
        self.codec_state = dict(state["codec"])
        self.steps_in_round = int(state["steps_in_round"])
        self._load_dylu(state.get("dylu"))
        self._round_began -= float(state.get("round_elapsed_s", 0.0))
