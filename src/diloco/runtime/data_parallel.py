"""The data-parallel baseline on the simulator's interface: one model, the k workers' batches
averaged every step (with one worker it is plain single-worker AdamW).

    diloco train --method dp --workers 4
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from diloco.core.inner import LossFn, gpt_loss
from diloco.core.outer_side import OuterSide
from diloco.errors import NonFinite
from diloco.runtime import RoundStats
from diloco.runtime.clock import Clock
from diloco.runtime.sim import DiLoCo, ModelFn, OptFn


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
        clock: Clock | None = None,
        **kwargs: Any,
    ):
        k = len(batches)

        def mean_loss(model: nn.Module, parts: list[Any]) -> torch.Tensor:
            return sum(loss_fn(model, b) for b in parts) / k

        super().__init__(
            model_fn,
            inner_opt_fn,
            [_Together(batches)],
            inner_steps=inner_steps,
            loss_fn=mean_loss,
            clock=clock or Clock([1.0]),
            **kwargs,
        )
        self.k = k
        # The single replica *is* the model: it starts from the global initialisation, and the
        # outer side (which never steps) holds it and the k workers' counters.
        worker = self.workers[0]
        worker.load_params(self.params)
        self.side = OuterSide(worker.model, k, seed=self.side.seed)

    @property
    def num_workers(self) -> int:
        return self.k

    def round(self, *, active: int | None = None) -> RoundStats:
        worker, side = self.workers[0], self.side
        total, lr = 0.0, 0.0
        for _ in range(self.inner_steps):
            loss, lr = worker.train_step()
            total += loss
        if not math.isfinite(total):  # one model: nothing to drop (--on-nonfinite drop is refused)
            raise NonFinite(
                f"the training loss became non-finite (NaN or Inf) in round {side.rounds_done + 1}; the "
                "run stopped and its last checkpoint is intact: start again with a lower --inner-lr."
            )
        step_bytes = side.param_bytes if self.k > 1 else 0
        for w in range(self.k):
            side.bytes_sent[w] += step_bytes * self.inner_steps
            side.bytes_received[w] += step_bytes * self.inner_steps
        self._sim_time_s += dp_steps_s(self.clock, self.k, self.inner_steps, step_bytes)
        side.inner_step += self.inner_steps
        side.total_steps += self.k * self.inner_steps
        side.worker_steps = [n + self.inner_steps for n in side.worker_steps]
        side.rounds_done += 1
        return self._stats([total / self.inner_steps], lr)


def dp_steps_s(clock: Clock, k: int, steps: int, step_bytes: int) -> float:
    """Simulated time of `steps` data-parallel steps of k workers: each step waits for the slowest
    worker, then every gradient goes up and the average comes back (two messages of `step_bytes`)
    over the slowest link, or (a ring) they are all-reduced; nothing overlaps (diloco plan uses it too)."""
    step_s = max(clock.step_s[:k] or [1.0])
    if clock.topology == "ring":  # an all-reduce of the gradients (float32, summable)
        return steps * (step_s + clock.exchange_s([step_bytes] * k, step_bytes, True))
    return steps * (step_s + 2 * clock.transfer_s(step_bytes))
