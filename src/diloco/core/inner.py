"""The inner loop (docs/method.md §1): a worker runs H AdamW steps from the global parameters
and returns outer_grad = θ_start − θ_local.

A worker owns its model replica, its inner optimizer state (kept across rounds, never sent),
its step count (which drives its lr schedule), its data iterator and its codec state (error
feedback of lossy codecs): it encodes its own outer_grad, as a remote worker would.

A job whose training loss or outer_grad is not finite is reported as such (`finite` False); the
worker then clears its inner optimizer state (AdamW moments full of NaN would spoil every later
job), and the outer side decides whether to stop the run or drop that outer_grad.

    python -m pytest tests/unit/test_sim.py tests/unit/test_outer.py
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from diloco.core.async_policy import another_step_fits
from diloco.core.codec import Codec, Encoded, Fp32Codec

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Loss for diloco's own GPT and batches: (inputs_BT, targets_BT)."""
    inputs_BT, targets_BT = batch
    return model(inputs_BT, targets_BT)


@torch.no_grad()
def outer_grad_from(start: list[torch.Tensor], params: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """outer_grad = start − params, on the start's device (the CPU for a GPU worker of the
    collective runtime), and whether every value of it is finite."""
    outer_grad = [s - p.to(s.device) for s, p in zip(start, params, strict=True)]
    return outer_grad, all(bool(torch.isfinite(g).all()) for g in outer_grad)


def merge_into(param: torch.Tensor, merged: torch.Tensor, alpha: float) -> None:
    """Streaming DiLoCo's merge of one tensor: param ← α·param + (1 − α)·merged (α = 0: replaced)."""
    if alpha == 0.0:
        param.copy_(merged)
    else:
        param.mul_(alpha).add_(merged.to(param.device), alpha=1.0 - alpha)


def encode_outer_grad(
    codec: Codec, outer_grad: list[torch.Tensor], finite: bool, state: dict[str, Any]
) -> Encoded:
    """The outer_grad's message through `codec` (its per-worker `state`: error feedback). A
    non-finite one is reported, never applied: a message of the right size, and the codec's
    state untouched."""
    if finite:
        return codec.encode(outer_grad, state)
    return codec.encode([torch.zeros_like(g) for g in outer_grad], None)


@dataclass
class InnerResult:
    """What a worker reports after its local steps."""

    outer_grad: list[torch.Tensor]  # θ_start − θ_local, one tensor per parameter
    steps: int
    mean_loss: float  # mean training loss over the steps
    last_lr: float
    finite: bool = True  # every loss and the outer_grad were finite
    message: Encoded | None = None  # the outer_grad encoded by the worker's codec

    def state_dict(self) -> dict[str, Any]:
        """The result as checkpoint state: its message, not the raw outer_grad (an async job's
        result saved with the job in flight)."""
        assert self.message is not None, "a result is saved with its encoded message"
        return {
            "steps": self.steps,
            "mean_loss": self.mean_loss,
            "last_lr": self.last_lr,
            "finite": self.finite,
            "message": self.message.state_dict(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> InnerResult:
        message = Encoded.from_state(state["message"])
        return cls(
            [],
            int(state["steps"]),
            float(state["mean_loss"]),
            float(state["last_lr"]),
            bool(state["finite"]),
            message,
        )


class Worker:
    """One DiLoCo worker: a model replica, its inner optimizer and its data.

    `lr_schedule(step) -> lr` (optional) sets the optimizer's lr before each step from the
    worker's own step count; `grad_clip` > 0 clips the global gradient norm.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Iterator,
        *,
        loss_fn: LossFn = gpt_loss,
        lr_schedule: Callable[[int], float] | None = None,
        grad_clip: float = 0.0,
        codec: Codec | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.batches = batches
        self.loss_fn = loss_fn
        self.lr_schedule = lr_schedule
        self.grad_clip = grad_clip
        self.codec = codec if codec is not None else Fp32Codec()  # encodes this worker's outer_grads
        self.codec_state: dict[str, Any] = {}  # the codec's per-worker state (error feedback)
        self.step = 0  # inner steps taken so far, over all rounds
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.anchor: list[torch.Tensor] | None = None  # streaming: the global θ last merged, per param

    def train_step(self, lr_step: int | None = None) -> tuple[float, float]:
        """One inner step on the next batch; returns (loss, lr). The lr schedule is driven by
        `lr_step` if given (e.g. a shard's step count), else by the worker's own step count."""
        if self.lr_schedule is not None:
            lr = self.lr_schedule(self.step if lr_step is None else lr_step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        lr = self.optimizer.param_groups[0]["lr"]
        loss = self.backward(next(self.batches))
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.step += 1
        return loss.item(), lr

    def backward(self, batch: Any) -> torch.Tensor:
        """The loss on `batch`, its gradient left in the parameters' .grad. (diloco replay
        computes a group worker's as the group did, run/replay.py.)"""
        loss = self.loss_fn(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    @staticmethod
    def may_step(done: int, spent_s: float, seconds: float | None) -> bool:
        """Whether a job's next inner step starts, after `done` steps in `spent_s` seconds: always
        for a job of steps; for a deadline of `seconds`, while another fits. The ranks of a group
        worker replace it with their leader's answer, so that they all take the same steps
        (run/group.py)."""
        return seconds is None or another_step_fits(done, spent_s, seconds)

    @torch.no_grad()
    def load_params(self, params: list[torch.Tensor]) -> None:
        for p, src in zip(self.params, params, strict=True):
            p.copy_(src)

    def run(
        self,
        start: list[torch.Tensor],
        steps: int,
        *,
        lr_step: int | None = None,
        shard: int | None = None,
        position: int | None = None,
        seconds: float | None = None,
        lr_stride: float = 1.0,
    ) -> InnerResult:
        """θ_local ← start; `steps` inner steps; return outer_grad = start − θ_local. With
        `start` None the worker continues from its own parameters (after a dropped outer_grad).
        With `seconds`, a deadline job (docs/method.md §2): at most `steps`, and no more than fit
        in `seconds` of this process's time (`async_policy.another_step_fits`); the result says
        how many it took.

        `lr_step`, if given, is the schedule step of the first of these steps: sync DiLoCo's
        round (so a worker that joins mid-run takes the run's lr, not a fresh warm-up), async's
        shard step count; step j then uses lr_step + ⌊j · `lr_stride`⌋ (sync DiLoCo with DyLU:
        every worker crosses the round's stretch of the schedule, core/dylu.py). `shard`, if
        given, makes the batches come from that shard from `position` (default `lr_step`; the
        batch source must have `seek(shard, step)`, as data.ShardSet does).
        """
        if shard is not None:
            self.batches.seek(shard, lr_step if position is None else position)
        if start is None:  # continue from the worker's own parameters
            start = [p.detach().clone() for p in self.params]
        self.load_params(start)
        total_loss, lr, began, taken = 0.0, 0.0, time.perf_counter(), 0
        for j in range(steps):
            if not self.may_step(j, time.perf_counter() - began, seconds):
                break
            at = j if lr_stride == 1.0 else math.floor(j * lr_stride)
            loss, lr = self.train_step(None if lr_step is None else lr_step + at)
            total_loss, taken = total_loss + loss, j + 1
        steps = taken
        outer_grad, grad_finite = outer_grad_from(start, self.params)
        finite = math.isfinite(total_loss) and grad_finite
        if not finite:
            self.optimizer.state.clear()  # fresh moments: the next job starts clean
        message = self._encode(outer_grad, finite, self.codec_state)
        return InnerResult(outer_grad, steps, total_loss / steps, lr, finite, message)

    def _encode(self, outer_grad: list[torch.Tensor], finite: bool, state: dict[str, Any]) -> Encoded:
        return encode_outer_grad(self.codec, outer_grad, finite, state)

    @torch.no_grad()
    def segment(
        self,
        steps: int,
        *,
        start: list[torch.Tensor] | None = None,
        anchor: list[torch.Tensor] | None = None,
        merge: tuple[list[int], list[torch.Tensor], float] | None = None,
        send: tuple[int, list[int]] | None = None,
    ) -> InnerResult:
        """Part of a Streaming DiLoCo round (streaming.py). In order: `start` replaces the
        parameters; `anchor` sets the global θ the worker measures outer_grads from; `merge`
        (indices, global tensors, α) mixes those parameters, θ ← α·θ + (1 − α)·global (α = 0:
        replaced), and makes the global tensors their anchor; `steps` inner steps; `send`
        (fragment p, indices) returns that fragment's outer_grad, anchor − θ, encoded with the
        fragment's own codec state."""
        if start is not None:
            self.load_params(start)
        if anchor is not None:
            self.anchor = [t.detach().clone().cpu() for t in anchor]
        if merge is not None:
            indices, tensors, alpha = merge
            for i, g in zip(indices, tensors, strict=True):
                merge_into(self.params[i], g, alpha)
                self.anchor[i] = g.detach().clone().cpu()
        total_loss, lr = 0.0, self.optimizer.param_groups[0]["lr"]
        with torch.enable_grad():
            for j in range(steps):
                self.may_step(j, 0.0, None)  # a job of steps: always (a group's leader may stop it)
                loss, lr = self.train_step()
                total_loss += loss
        if send is None:
            return InnerResult([], steps, total_loss / max(1, steps), lr, math.isfinite(total_loss))
        p, indices = send
        outer_grad = [self.anchor[i] - self.params[i].detach().to(self.anchor[i].device) for i in indices]
        finite = math.isfinite(total_loss) and all(bool(torch.isfinite(g).all()) for g in outer_grad)
        message = self._encode(outer_grad, finite, self.codec_state.setdefault(f"fragment{p}", {}))
        return InnerResult(outer_grad, steps, total_loss / max(1, steps), lr, finite, message)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "codec": self.codec_state,
        }
        if hasattr(self.batches, "state_dict"):
            state["batches"] = self.batches.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.codec_state = dict(state.get("codec", {}))
        if "batches" in state:
            self.batches.load_state_dict(state["batches"])
