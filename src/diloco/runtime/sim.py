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
from diloco.outer import Nesterov, OuterOpt, kept_weights, weighted_average
from diloco.runtime.clock import Clock
from diloco.runtime.pool import InlinePool, ProcessPool
from diloco.schedule import outer_grad_dropped

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


def make_worker(model_fn: ModelFn, inner_opt_fn: OptFn, batches: Iterator, **kwargs: Any) -> Worker:
    """A worker with a fresh replica (its values are replaced by the global parameters at the
    start of every job) and its own inner optimizer."""
    with torch.random.fork_rng(devices=[]):  # building a replica must not move the seed's stream
        replica = model_fn()
    return Worker(
        replica, inner_opt_fn([p for p in replica.parameters() if p.requires_grad]), batches, **kwargs
    )


class DiLoCo:
    """Synchronous DiLoCo (ALGORITHMS.md §1) over simulated workers.

    Each round every worker starts from the global parameters, runs `inner_steps` steps of its
    own optimizer on its own batches, and sends outer_grad = θ_start − θ_local through `codec`;
    the weighted average (weights default 1/k) is applied by `outer_opt` (default Nesterov,
    lr 0.7, momentum 0.9). `model` holds the global parameters.

    Workers come from `inner_opt_fn` and `batches` (one iterator per worker), or ready-made in a
    `pool` (runtime/pool.py: inline or in several processes). `clock` (runtime/clock.py) gives
    simulated durations; by default every inner step takes 1 s and messages are free. A round
    ends when the last worker's push lands.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        inner_opt_fn: OptFn | None = None,
        batches: Sequence[Iterator] | None = None,
        *,
        inner_steps: int,
        loss_fn: LossFn = gpt_loss,
        outer_opt: OuterOpt | None = None,
        weights: Sequence[float] | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        grad_clip: float = 0.0,
        codec: Codec | None = None,
        pool: InlinePool | ProcessPool | None = None,
        clock: Clock | None = None,
        drop_prob: float = 0.0,
        seed: int = 0,
    ):
        self.model = model_fn()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if pool is None:
            if inner_opt_fn is None or batches is None:
                raise ValueError("DiLoCo needs inner_opt_fn and batches (one iterator per worker), or a pool")
            pool = InlinePool(
                [
                    make_worker(
                        model_fn,
                        inner_opt_fn,
                        it,
                        loss_fn=loss_fn,
                        lr_schedule=lr_schedule,
                        grad_clip=grad_clip,
                    )
                    for it in batches
                ]
            )
        k = len(pool)
        if k < 1 or inner_steps < 1:
            raise ValueError(f"DiLoCo needs at least one worker and inner_steps >= 1, got {k}, {inner_steps}")
        weights = list(weights) if weights is not None else [1.0 / k] * k
        if len(weights) != k or abs(sum(weights) - 1.0) > 1e-6 or min(weights) < 0:
            raise ValueError(f"weights must be {k} non-negative numbers summing to 1, got {weights}")
        self.pool = pool
        self.inner_steps = inner_steps
        self.outer_opt = outer_opt if outer_opt is not None else Nesterov()
        self.weights = weights
        self.codec = codec or Fp32Codec()
        self.clock = clock or Clock([1.0] * k)
        self.drop_prob, self.seed = drop_prob, seed
        self.own_start = [False] * k  # workers whose last outer_grad was dropped
        self.version = 0
        self.rounds_done = 0
        self.total_steps = 0  # inner steps over all workers
        self.inner_step = 0  # inner steps each (always active) worker has taken
        self.sim_time_s = 0.0
        self.bytes_sent = [0] * k
        self.bytes_received = [0] * k

    @property
    def num_workers(self) -> int:
        return len(self.pool)

    @property
    def workers(self) -> list[Worker]:
        """The worker objects, when they live in this process."""
        return self.pool.workers

    def round(self, *, active: int | None = None) -> RoundStats:
        """One outer step: every active worker's inner steps, then the averaged outer update.

        `active` (default all) workers take part: the first `active` ones. With `drop_prob`, each
        outer_grad is lost with that probability; its worker then continues from its own
        parameters next round, and the others' weights are rescaled to sum to 1.
        """
        n, H, start = active or self.num_workers, self.inner_steps, self.sim_time_s
        for w in range(n, self.num_workers):  # an inactive worker rejoins from the global parameters
            self.own_start[w] = False
        pull_bytes = tensor_bytes(self.params)
        for w in range(n):  # all jobs first, so a process pool computes them side by side
            if self.own_start[w]:
                self.pool.submit(w, None, H)
            else:
                self.bytes_received[w] += pull_bytes
                self.pool.submit(w, self.params, H)
        outer_grads, kept, losses, lr, end = [], [], [], 0.0, start
        for w in range(n):
            result = self.pool.result(w)
            message = self.codec.encode(result.outer_grad)
            self.bytes_sent[w] += message.nbytes
            self.own_start[w] = outer_grad_dropped(self.seed, self.rounds_done, w, self.drop_prob)
            kept.append(not self.own_start[w])
            if kept[-1]:
                outer_grads.append(self.codec.decode(message))
            losses.append(result.mean_loss)
            lr = result.last_lr
            pulled = start + self.clock.transfer_s(pull_bytes)
            computed = pulled + self.clock.compute_s(w, pulled, H, job=self.rounds_done)
            end = max(end, computed + self.clock.transfer_s(message.nbytes))
        if outer_grads:
            self.outer_opt.step(self.params, weighted_average(outer_grads, kept_weights(self.weights, kept)))
            self.version += 1
        self.rounds_done += 1
        self.inner_step += H
        self.total_steps += n * H
        self.sim_time_s = end
        return self._stats(losses, lr)

    def _stats(self, losses: list[float], lr: float) -> RoundStats:
        return RoundStats(
            self.version,
            self.inner_step,
            losses,
            lr,
            list(self.bytes_sent),
            list(self.bytes_received),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "global": self.model.state_dict(),
            "outer_opt": self.outer_opt.state_dict(),
            "workers": self.pool.state_dict(),
            "version": self.version,
            "rounds_done": self.rounds_done,
            "total_steps": self.total_steps,
            "own_start": list(self.own_start),
            "inner_step": self.inner_step,
            "sim_time_s": self.sim_time_s,
            "bytes_sent": list(self.bytes_sent),
            "bytes_received": list(self.bytes_received),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["global"])
        self.outer_opt.load_state_dict(state["outer_opt"])
        self.pool.load_state_dict(state["workers"])
        self.version = int(state["version"])
        self.rounds_done = int(state["rounds_done"])
        self.total_steps = int(state["total_steps"])
        self.own_start = [bool(x) for x in state["own_start"]]
        self.inner_step = int(state["inner_step"])
        self.sim_time_s = float(state["sim_time_s"])
        self.bytes_sent = [int(b) for b in state["bytes_sent"]]
        self.bytes_received = [int(b) for b in state["bytes_received"]]

    def close(self, *, clean: bool = True) -> None:
        self.pool.close()


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
        self.bytes_sent = [0] * k
        self.bytes_received = [0] * k
        # The single replica *is* the model: it starts from the global initialisation.
        worker = self.workers[0]
        worker.load_params(self.params)
        self.model, self.params = worker.model, worker.params

    @property
    def num_workers(self) -> int:
        return self.k

    def round(self, *, active: int | None = None) -> RoundStats:
        worker = self.workers[0]
        total, lr = 0.0, 0.0
        for _ in range(self.inner_steps):
            loss, lr = worker.train_step()
            total += loss
        step_bytes = tensor_bytes(self.params) if self.k > 1 else 0
        self.bytes_sent = [b + step_bytes * self.inner_steps for b in self.bytes_sent]
        self.bytes_received = [b + step_bytes * self.inner_steps for b in self.bytes_received]
        # Every step waits for the slowest worker's gradient (one step each, then an exchange).
        step_s = max(self.clock.step_s[: self.k] or [1.0])
        self.sim_time_s += self.inner_steps * (step_s + 2 * self.clock.transfer_s(step_bytes))
        self.inner_step += self.inner_steps
        self.total_steps += self.k * self.inner_steps
        self.rounds_done += 1
        return self._stats([total / self.inner_steps], lr)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        del state["global"]  # the same tensors as the worker's model
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({**state, "global": self.model.state_dict()})
