"""Sync DiLoCo with dynamic local updates (`--method diloco --dylu`, docs/method.md §2): every
round each worker takes as many inner steps as fit in the round's time at its measured speed, and
all of them sync together, so the fast ones do not wait for the slow ones and nothing is stale.

The rules are the asynchronous server's (async_policy.py): H_w = max(1, ⌊v_w / max v · H⌋) from
each worker's measured seconds per step (`--dylu-by steps`), or a deadline of H × the fastest
measured seconds per step that every worker trains until (`--dylu-by time`). What sync adds:

- The first round measures: no speed is known, so every worker takes H (plain sync DiLoCo).
- The run's budget is k × rounds × H inner steps, as plain sync's; rounds go on until it is
  spent, the last one scaled down to what is left (each H_w × left ÷ Σ H_w, at least 1), and
  the run ends when less is left than a step for every worker (it may fall short by k − 1).
- A worker's step j of its H_w uses the inner lr of schedule step lr_step + ⌊j · advance / H_w⌋,
  where lr_step is the steps spent so far ÷ k and advance this round's steps ÷ k: every worker
  crosses the same stretch of the schedule each round, whatever its H_w.
- outer_grads are weighted by the steps each worker took (OuterSide.begin_round(steps=...)): a
  worker's outer_grad is the sum of its H_w updates, and weighting by steps is weighting by the
  tokens each worker learned from, as FedAvg weights clients by examples.
- A worker within `SYNC_TOLERANCE` of the fastest takes H: measured speeds of equal machines
  differ by timing noise, which must not make them take different H (with equal speeds every
  worker takes H every round, and the run is plain sync DiLoCo bit for bit).

Every runtime uses `RoundPlanner`: the simulator with its clock's times, torchrun with the times
its ranks measure and all-gather (`DistributedDiLoCo(dylu=True)` too, in a user's own loop), the
parameter server with its workers' reported times.

    diloco train --dylu --heterogeneity very --rounds 8
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from diloco.core.async_policy import SpeedEstimator, dylu_steps, job_seconds

# a worker whose measured speed is within this fraction of the fastest's takes H (timing noise)
SYNC_TOLERANCE = 0.05
# a deadline job takes at most DEADLINE_CAP × the steps expected to fit (core/async_policy.py)


@dataclass
class RoundPlan:
    """One round of sync DiLoCo with DyLU, for the first len(steps) workers."""

    steps: list[int]  # H_w per worker (with a deadline: the steps expected to fit)
    seconds: float | None  # --dylu-by time: every worker trains until this many seconds
    lr_step: int  # the schedule step the round starts at
    lr_strides: list[float]  # per worker: schedule steps per inner step (1.0: plain sync)


class RoundPlanner:
    """Plans each round's H_w from the workers' measured speeds and counts the budget spent.

    `budget` is the run's inner steps summed over workers (k × rounds × H); `by` "steps" or
    "time"; `alpha` the weight of a new measurement in each worker's speed estimate.
    """

    def __init__(
        self, num_workers: int, inner_steps: int, budget: int, *, by: str = "steps", alpha: float = 0.5
    ):
        if by not in ("steps", "time"):
            raise ValueError(f"by must be 'steps' or 'time', got {by!r}")
        self.k, self.H, self.budget, self.by = num_workers, inner_steps, budget, by
        self.estimators = [SpeedEstimator(alpha) for _ in range(num_workers)]
        self.spent = 0  # inner steps taken so far, summed over workers

    @property
    def done(self) -> bool:
        """The budget is spent: less is left than one step for every worker."""
        return self.budget - self.spent < self.k

    @property
    def rounds_estimate(self) -> float:
        """Rounds of plain sync the spent budget amounts to (for progress bars)."""
        return self.spent / (self.k * self.H)

    def speeds(self) -> list[float | None]:
        return [e.step_s for e in self.estimators]

    def plan(self, step_s: list[float | None] | None = None, members: list[int] | None = None) -> RoundPlan:
        """The next round, from `step_s` (seconds per step of each worker; default the measured
        estimates; None where unknown), for `members` (default every worker; the others get 0
        steps: the parameter server's rounds have the workers registered). A member whose speed
        is unknown makes it a plain round of H."""
        step_s = self.speeds() if step_s is None else step_s
        members = list(range(self.k)) if members is None else list(members)
        mine = [step_s[w] for w in members]
        left = self.budget - self.spent
        seconds = None
        if None in mine:
            planned = [self.H] * len(mine)
        elif self.by == "time":
            seconds = job_seconds(self.H, mine)
            # the steps a deadline is expected to hold at each worker's estimated speed
            planned = [max(1, math.floor(seconds / s * (1 + 1e-9))) for s in mine]
        else:
            planned = dylu_steps(mine, self.H, tolerance=SYNC_TOLERANCE)
        if sum(planned) > left:  # the last round: scaled down to the budget, as H_w steps
            planned = [max(1, s * left // sum(planned)) for s in planned]
            seconds = None
        steps, strides = [0] * self.k, [1.0] * self.k
        advance = sum(planned) / self.k
        for w, n in zip(members, planned, strict=True):
            steps[w] = n
            if len(set(planned)) > 1 or seconds is not None:  # equal: exactly plain sync's lr positions
                strides[w] = advance / n
        return RoundPlan(steps, seconds, self.spent // self.k, strides)

    def record(self, w: int, seconds: float, steps: int) -> None:
        """Worker w took `steps` inner steps in `seconds` this round."""
        self.estimators[w].update(seconds, steps)

    def spend(self, steps: int) -> int:
        """Count a round's steps (summed over workers); returns how far the per-worker lr step
        advanced (its sum over the run is spent ÷ k)."""
        before = self.spent // self.k
        self.spent += steps
        return self.spent // self.k - before

    def state_dict(self) -> dict[str, Any]:
        return {"spent": self.spent, "step_s": self.speeds()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spent = int(state["spent"])
        for e, s in zip(self.estimators, state["step_s"], strict=True):
            e.step_s = None if s is None else float(s)
