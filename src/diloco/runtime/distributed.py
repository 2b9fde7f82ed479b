"""Sync DiLoCo in your own training loop, across real processes (torchrun, torch.distributed).

Each process is one DiLoCo worker. You keep your model, your inner optimizer and your loop; call
`step()` after each inner optimizer step, and every `inner_steps` calls it runs the outer step:
every worker's outer_grad θ_global − θ_local goes through the codec, the messages are averaged
across the processes, the outer optimizer updates θ_global, and your model's parameters become
θ_global. The outer side (core/outer_side.py), the encoding (core/inner.py) and the bucketed
all-reduce (runtime/collective.py) are the ones `diloco train` runs, so with the same model,
data and seed it gives the global parameters the simulator's `DiLoCo` gives (bitwise with two
processes; tested in tests/integration/test_distributed_library.py).

    torchrun --standalone --nproc-per-node 2 train.py     # train.py: README.md's example
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from diloco.core.codec import Codec, Encoded, Fp32Codec
from diloco.core.inner import encode_outer_grad, outer_grad_from
from diloco.core.outer import Nesterov, OuterOpt
from diloco.core.outer_side import OuterSide
from diloco.runtime.collective import sum_in_buckets


class DistributedDiLoCo:
    """The outer side of sync DiLoCo for one process of a torch.distributed job.

    `model` is this worker's model (on any device); its trainable parameters are synchronised
    (buffers, such as BatchNorm statistics, stay local). At construction every process takes
    rank 0's parameters, so the workers start equal whatever their seeds. θ_global is kept on
    the CPU (one copy of the parameters, plus the outer optimizer's state). `group` is the
    process group the workers talk over (default: the whole job); it must be able to move CPU
    tensors (gloo: for a job on NCCL, pass `torch.distributed.new_group(backend="gloo")`).
    `codec` encodes each outer_grad (default fp32; e.g. `build_codec("fp4",
    error_feedback=True)`: the error feedback is this process's own). `on_nonfinite` "stop"
    raises `NonFinite` on every process when any worker's outer_grad holds a NaN or Inf; "drop"
    leaves it out of the average (that worker restarts from θ_global; clear its inner
    optimizer's state, whose moments may hold NaN, as diloco's own workers do).
    """

    def __init__(
        self,
        model: nn.Module,
        inner_steps: int,
        *,
        outer_opt: OuterOpt | None = None,
        codec: Codec | None = None,
        group: dist.ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        on_nonfinite: str = "stop",
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDiLoCo needs a torch.distributed job: call "
                "torch.distributed.init_process_group() first (torchrun sets its environment)"
            )
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
        self.model, self.inner_steps, self.group, self.bucket_mb = model, inner_steps, group, bucket_mb
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():  # rank 0's parameters everywhere
            for p in self.params:
                value = p.detach().cpu().contiguous()
                dist.broadcast(value, src=dist.get_global_rank(group, 0) if group else 0, group=group)
                p.copy_(value)
        global_model = copy.deepcopy(model).cpu()
        self.side = OuterSide(
            global_model,
            self.world,
            update=outer_opt if outer_opt is not None else Nesterov(),
            codec=codec or Fp32Codec(),
            on_nonfinite=on_nonfinite,
        )
        self.codec_state: dict[str, Any] = {}  # this worker's codec state (error feedback)
        self.steps_in_round = 0

    @property
    def global_params(self) -> list[torch.Tensor]:
        """θ_global (CPU): the same on every process."""
        return self.side.params

    version = property(lambda self: self.side.version)  # outer updates applied so far

    @property
    def bytes_sent(self) -> int:
        """This worker's encoded outer_grads so far, in bytes (what the codec makes of them)."""
        return self.side.bytes_sent[self.rank]

    def step(self) -> bool:
        """Count one inner step; at every `inner_steps`-th, run the outer step (every process
        must call it equally often). Returns whether this call synchronised."""
        self.steps_in_round += 1
        if self.steps_in_round < self.inner_steps:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now, on the inner steps taken since the last one (every process must
        call it together; `step()` calls it for you every `inner_steps`). With no inner step
        since the last one it does nothing (an outer step on nothing would still move θ_global
        by the outer momentum)."""
        if self.steps_in_round == 0:
            return
        side, w = self.side, self.rank
        side.begin_round()
        outer_grad, finite = outer_grad_from(side.params, self.params)
        message = encode_outer_grad(side.codec, outer_grad, finite, self.codec_state)
        # every process learns every worker's message size and finiteness: the same decisions
        mine = torch.tensor([message.nbytes, int(finite)], dtype=torch.int64)
        every = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        for i, row in enumerate(every):
            side.report(i, int(row[0]), bool(row[1]))
        if side.codec.summable:
            summed = sum_in_buckets(side.contribution(w, message), self.bucket_mb, self._all_reduce)
        else:  # messages that cannot be summed: every worker's, reduced in worker order
            blobs: list[Any] = [None] * self.world
            dist.all_gather_object(blobs, message.to_bytes(), group=self.group)
            summed = side.reduce([Encoded.from_bytes(b) for b in blobs])
        side.end_round(summed, self.steps_in_round)
        for p, g in zip(self.params, side.params, strict=True):
            p.copy_(g)
        self.steps_in_round = 0

    def _all_reduce(self, bucket: torch.Tensor) -> None:
        dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self.group)

    def state_dict(self) -> dict[str, Any]:
        """The outer state to checkpoint with your model and inner optimizer: θ_global, the
        outer optimizer, this worker's codec state and its place in the round."""
        return {
            "outer": self.side.state_dict(),
            "codec": self.codec_state,
            "steps_in_round": self.steps_in_round,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.side.load_state_dict(state["outer"])
        self.codec_state = dict(state["codec"])
        self.steps_in_round = int(state["steps_in_round"])
