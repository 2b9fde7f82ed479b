"""The simulator runtime: k workers in one process, one after another each round.

`DiLoCo` is also the library API: give it a model factory, an inner optimizer factory and one
batch iterator per worker, and call `round()` from your own loop. `DataParallel` is the
baseline on the same interface: one model, the k workers' batches averaged every step (with
one worker it is plain single-worker AdamW). Bytes are real message sizes: each round a worker
downloads the global parameters and uploads its encoded outer_grad.

    diloco train --workers 4 --inner-steps 50 --rounds 6
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from diloco.codec import Codec, Fp32Codec, tensor_bytes
from diloco.inner import LossFn, Worker, gpt_loss
from diloco.outer import Nesterov, OuterOpt, weighted_average

ModelFn = Callable[[], nn.Module]
OptFn = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class RoundStats:
    """What one round did: per-worker losses and the cumulative communication counters."""

    version: int  # outer updates applied so far
    inner_step: int  # inner steps each worker has taken so far
    losses: list[float]  # mean training loss of each worker over the round
    lr: float  # inner lr of the round's last step
    bytes_sent: list[int] = field(default_factory=list)  # cumulative, per worker
    bytes_received: list[int] = field(default_factory=list)  # cumulative, per worker


def _replica(global_model: nn.Module, model_fn: ModelFn) -> nn.Module:
    replica = model_fn()
    replica.load_state_dict(global_model.state_dict())
    return replica


class DiLoCo:
    """Synchronous DiLoCo (ALGORITHMS.md §1) over in-process workers.

    Each round every worker starts from the global parameters, runs `inner_steps` steps of its
    own optimizer on its own batches, and sends outer_grad = θ_start − θ_local through `codec`;
    the weighted average (weights default 1/k) is applied by `outer_opt` (default Nesterov,
    lr 0.7, momentum 0.9). `model` holds the global parameters.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        inner_opt_fn: OptFn,
        batches: Sequence[Iterator],
        *,
        inner_steps: int,
        loss_fn: LossFn = gpt_loss,
        outer_opt: OuterOpt | None = None,
        weights: Sequence[float] | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        grad_clip: float = 0.0,
        codec: Codec | None = None,
    ):
        k = len(batches)
        if k < 1 or inner_steps < 1:
            raise ValueError(f"DiLoCo needs at least one worker and inner_steps >= 1, got {k}, {inner_steps}")
        weights = list(weights) if weights is not None else [1.0 / k] * k
        if len(weights) != k or abs(sum(weights) - 1.0) > 1e-6 or min(weights) < 0:
            raise ValueError(f"weights must be {k} non-negative numbers summing to 1, got {weights}")
        self.model = model_fn()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.workers = []
        for it in batches:
            replica = _replica(self.model, model_fn)
            self.workers.append(
                Worker(
                    replica,
                    inner_opt_fn([p for p in replica.parameters() if p.requires_grad]),
                    it,
                    loss_fn=loss_fn,
                    lr_schedule=lr_schedule,
                    grad_clip=grad_clip,
                )
            )
        self.inner_steps = inner_steps
        self.outer_opt = outer_opt if outer_opt is not None else Nesterov()
        self.weights = weights
        self.codec = codec or Fp32Codec()
        self.version = 0
        self.bytes_sent = [0] * k
        self.bytes_received = [0] * k

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def round(self) -> RoundStats:
        """One outer step: every worker's inner steps, then the averaged outer update."""
        outer_grads, losses, lr = [], [], 0.0
        for i, worker in enumerate(self.workers):
            self.bytes_received[i] += tensor_bytes(self.params)  # pull θ
            result = worker.run(self.params, self.inner_steps)
            message = self.codec.encode(result.outer_grad)
            self.bytes_sent[i] += message.nbytes  # push outer_grad
            outer_grads.append(self.codec.decode(message))
            losses.append(result.mean_loss)
            lr = result.last_lr
        self.outer_opt.step(self.params, weighted_average(outer_grads, self.weights))
        self.version += 1
        return self._stats(losses, lr)

    def _stats(self, losses: list[float], lr: float) -> RoundStats:
        return RoundStats(
            self.version, self.workers[0].step, losses, lr, list(self.bytes_sent), list(self.bytes_received)
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "global": self.model.state_dict(),
            "outer_opt": self.outer_opt.state_dict(),
            "workers": [w.state_dict() for w in self.workers],
            "version": self.version,
            "bytes_sent": list(self.bytes_sent),
            "bytes_received": list(self.bytes_received),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["global"])
        self.outer_opt.load_state_dict(state["outer_opt"])
        for worker, ws in zip(self.workers, state["workers"], strict=True):
            worker.load_state_dict(ws)
        self.version = int(state["version"])
        self.bytes_sent = [int(b) for b in state["bytes_sent"]]
        self.bytes_received = [int(b) for b in state["bytes_received"]]


class _Together:
    """One batch from each of k iterators per step (the data-parallel global batch)."""

    def __init__(self, iterators: Sequence[Iterator]):
        self.iterators = list(iterators)

    def __iter__(self):
        return self

    def __next__(self) -> list[Any]:
        return [next(it) for it in self.iterators]

    def state_dict(self) -> dict:
        return {"parts": [it.state_dict() for it in self.iterators if hasattr(it, "state_dict")]}

    def load_state_dict(self, state: dict) -> None:
        for it, s in zip(self.iterators, state["parts"], strict=True):
            it.load_state_dict(s)


class DataParallel(DiLoCo):
    """Data parallel baseline: one model, each step the mean loss of the k workers' batches
    (= the mean of their gradients, i.e. a k× batch), then one inner optimizer step.

    Bytes are what real data parallel sends: each worker uploads its gradient and downloads the
    parameters every step. With one worker this is plain AdamW and nothing is sent.
    A round is `inner_steps` steps; no outer update happens, so `version` stays 0.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        inner_opt_fn: OptFn,
        batches: Sequence[Iterator],
        *,
        inner_steps: int,
        loss_fn: LossFn = gpt_loss,
        **kwargs: Any,
    ):
        k = len(batches)

        def mean_loss(model: nn.Module, parts: list[Any]) -> torch.Tensor:
            return sum(loss_fn(model, b) for b in parts) / k

        super().__init__(
            model_fn, inner_opt_fn, [_Together(batches)], inner_steps=inner_steps, loss_fn=mean_loss, **kwargs
        )
        self.k = k
        self.bytes_sent = [0] * k
        self.bytes_received = [0] * k
        # The single replica *is* the model: no copy of the global parameters is kept.
        self.model = self.workers[0].model
        self.params = self.workers[0].params

    @property
    def num_workers(self) -> int:
        return self.k

    def round(self) -> RoundStats:
        worker = self.workers[0]
        total, lr = 0.0, 0.0
        for _ in range(self.inner_steps):
            loss, lr = worker.train_step()
            total += loss
        if self.k > 1:
            step_bytes = tensor_bytes(self.params) * self.inner_steps
            self.bytes_sent = [b + step_bytes for b in self.bytes_sent]
            self.bytes_received = [b + step_bytes for b in self.bytes_received]
        return self._stats([total / self.inner_steps], lr)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        del state["global"]  # the same tensors as the worker's model
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({**state, "global": self.model.state_dict()})
