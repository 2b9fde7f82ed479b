"""Asynchronous Local-SGD in the simulator (ALGORITHMS.md §2), on the virtual clock.

A worker pulls θ (at `version` v), runs its local steps, and pushes outer_grad = θ_pulled −
θ_local; the server applies it at once to the current θ with an `AsyncRule`, and the worker
pulls again. Events are processed in simulated-time order (ties by worker index), so a run is
deterministic for a seed whatever the number of processes computing the workers.

The server also decides each job: how many steps (H, or DyLU's H_w from estimated or true
speeds), which shard (the worker's own, or sampled), and, with a grace period, holds back
workers that finish within `grace_s` of an update so they restart from the same θ.

    diloco train --method async --async-rule dn --dylu --heterogeneity very
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass

from diloco.async_rules import AsyncRule, DelayComp
from diloco.codec import Codec, Fp32Codec, tensor_bytes
from diloco.runtime.clock import Clock
from diloco.runtime.pool import InlinePool, ProcessPool
from diloco.runtime.sim import ModelFn
from diloco.schedule import SpeedEstimator, dylu_steps, shard_probabilities


@dataclass
class Arrival:
    """One outer_grad applied (or dropped) by the server."""

    worker: int
    steps: int  # inner steps of this job (H_w)
    staleness: int  # versions applied between the worker's pull and this push
    changed: bool  # whether θ changed (a new version)
    train_loss: float
    lr: float
    shard: int
    speed_est_s: float | None  # the worker's estimated seconds per step after this job
    sim_time_s: float


class AsyncDiLoCo:
    """The asynchronous server and its workers, driven by the virtual clock.

    `total_steps` is the compute budget: inner steps over all workers (k × rounds × H for equal
    compute with sync). `run(on_arrival)` processes every push in time order.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        pool: InlinePool | ProcessPool,
        *,
        rule: AsyncRule,
        clock: Clock,
        inner_steps: int,
        total_steps: int,
        codec: Codec | None = None,
        dylu: bool = False,
        dylu_oracle: bool = False,
        dylu_alpha: float = 0.5,
        grace_s: float = 0.0,
        shard_sizes: list[int] | None = None,
        seed: int = 0,
    ):
        self.model = model_fn()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.pool, self.rule, self.clock = pool, rule, clock
        self.codec = codec or Fp32Codec()
        k = len(pool)
        self.inner_steps, self.total_steps = inner_steps, total_steps
        self.dylu, self.dylu_oracle, self.grace_s = dylu or dylu_oracle, dylu_oracle, grace_s
        self.estimators = [SpeedEstimator(dylu_alpha) for _ in range(k)]
        self.shard_sizes = shard_sizes  # None: every worker keeps its own shard
        self.shard_steps = [0] * (len(shard_sizes) if shard_sizes else k)
        self.rng = random.Random(seed)
        self.version = 0
        self.sim_time_s = 0.0
        self.dispatched = 0  # inner steps handed out
        self.applied = 0  # inner steps whose outer_grad has arrived
        self.bytes_sent = [0] * k
        self.bytes_received = [0] * k
        self._jobs = [0] * k  # jobs per worker, numbering jitter draws
        self._heap: list[tuple[float, int, int]] = []
        self._inflight: dict[int, dict] = {}

    @property
    def num_workers(self) -> int:
        return len(self.pool)

    def _steps_for(self, w: int, t: float) -> int:
        if not self.dylu:
            return self.inner_steps
        if self.dylu_oracle:
            speeds = [self.clock.true_step_s(i, t) for i in range(self.num_workers)]
        else:
            known = [e.step_s for e in self.estimators]
            if known[w] is None:  # not measured yet: a full job, which measures it
                return self.inner_steps
            speeds = [s if s is not None else known[w] for s in known]
        return dylu_steps(speeds, self.inner_steps)[w]

    def _pick_shard(self, w: int) -> int | None:
        if self.shard_sizes is None:
            return None
        probs = shard_probabilities(self.shard_sizes, self.shard_steps)
        return self.rng.choices(range(len(probs)), weights=probs)[0]

    def _dispatch(self, w: int, t: float) -> None:
        steps = min(self._steps_for(w, t), self.total_steps - self.dispatched)
        if steps <= 0:
            return
        shard = self._pick_shard(w)
        key = w if shard is None else shard
        shard_step = self.shard_steps[key]
        self.shard_steps[key] += steps
        pull_bytes = tensor_bytes(self.params)
        self.bytes_received[w] += pull_bytes
        self.pool.submit(w, self.params, steps, lr_step=shard_step, shard=shard)
        pulled_at = t + self.clock.transfer_s(pull_bytes)
        compute_s = self.clock.compute_s(w, pulled_at, steps, job=self._jobs[w])
        arrival = pulled_at + compute_s + self.clock.transfer_s(self.codec.message_bytes(self.params))
        self._jobs[w] += 1
        self.dispatched += steps
        pulled = [p.detach().clone() for p in self.params] if isinstance(self.rule, DelayComp) else None
        self._inflight[w] = {
            "steps": steps,
            "compute_s": compute_s,
            "version": self.version,
            "pulled": pulled,
            "shard": key,
        }
        heapq.heappush(self._heap, (arrival, w, w))

    def _arrive(self, w: int, t: float) -> Arrival:
        job = self._inflight.pop(w)
        result = self.pool.result(w)
        message = self.codec.encode(result.outer_grad)
        self.bytes_sent[w] += message.nbytes
        staleness = self.version - job["version"]
        changed = self.rule.apply(
            self.params, self.codec.decode(message), worker=w, staleness=staleness, pulled=job["pulled"]
        )
        self.version += int(changed)
        self.applied += job["steps"]
        self.sim_time_s = t
        estimate = self.estimators[w].update(job["compute_s"], job["steps"])
        return Arrival(
            w, job["steps"], staleness, changed, result.mean_loss, result.last_lr, job["shard"], estimate, t
        )

    def run(self, on_arrival: Callable[[Arrival], None] = lambda a: None) -> None:
        """Hand out the first jobs, then process every push in simulated-time order."""
        for w in range(self.num_workers):
            self._dispatch(w, 0.0)
        while self._heap:
            t, _, w = heapq.heappop(self._heap)
            group = [(t, w)]
            # Grace period: workers finishing soon after this update are synced too, then all
            # restart together from the same θ.
            while self.grace_s > 0 and self._heap and self._heap[0][0] <= t + self.grace_s:
                ta, _, wa = heapq.heappop(self._heap)
                group.append((ta, wa))
            for ta, wa in group:
                on_arrival(self._arrive(wa, ta))
            restart = t
            if self.grace_s > 0:
                restart = group[-1][0] if not self._heap else t + self.grace_s
            for _, wa in group:
                self._dispatch(wa, restart)
        # Arrivals a rule still holds (a buffer of fewer than N at the end) are not lost.
        self.version += int(self.rule.flush(self.params))

    def close(self, *, clean: bool = True) -> None:
        self.pool.close()
