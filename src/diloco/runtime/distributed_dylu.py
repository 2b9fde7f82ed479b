"""Sync DiLoCo with dynamic local updates (DyLU, core/dylu.py) in `DistributedDiLoCo`, a user's
own loop: each worker times its rounds (from one sync to the next, by `timer`), the sync
all-gathers the times, and every process plans the next round alike with `RoundPlanner`: the
fastest workers take H inner steps, a slower one H_w = ⌊v_w / max v · H⌋, so all reach the sync
together; outer_grads are weighted by the steps taken. The first round has no times: every worker
takes H. With the same speeds the rounds are the simulator's sync DiLoCo with DyLU (tested with a
scripted timer in tests/integration/test_distributed_library.py).

    outer = DistributedDiLoCo(model, inner_steps=100, dylu=True)
    while outer.version < rounds:        # workers take different numbers of steps
        ...                              # an inner step, its lr at outer.schedule_step
        outer.step()
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from diloco.core.dylu import RoundPlanner

UNBOUNDED = 2**62  # DyLU's budget of inner steps: the user's loop decides when the run ends


class DyluSteps:
    """The DyLU side of `DistributedDiLoCo` (distributed.py), which provides the worker id, the
    outer side and the step count."""

    def _setup_dylu(self, dylu: bool, timer: Callable[[], float] | None) -> None:
        self.planner = RoundPlanner(self.k, self.inner_steps, UNBOUNDED) if dylu else None
        self._plan = self.planner.plan() if dylu else None
        self.timer = timer or time.perf_counter
        self._round_began = self.timer()

    @property
    def round_steps(self) -> int:
        """This worker's inner steps in this round: `inner_steps`, or with DyLU its H_w."""
        return self.inner_steps if self._plan is None else self._plan.steps[self.worker_id]

    @property
    def schedule_step(self) -> int:
        """The learning-rate schedule's step for the next inner step: the steps taken so far, per
        worker. With DyLU the workers take different numbers of steps a round but cross the same
        stretch of the schedule (step j of H_w is lr_step + ⌊j · stride⌋, as the simulator's):
        set the inner lr from this, not from a count of your own steps."""
        if self._plan is None:
            return self.side.inner_step + self.steps_in_round
        j, stride = self.steps_in_round, self._plan.lr_strides[self.worker_id]
        return self._plan.lr_step + (j if stride == 1.0 else math.floor(j * stride))

    def _elapsed_us(self) -> int:
        """This round's time so far, in microseconds (what the sync gathers); 0 without DyLU."""
        return round((self.timer() - self._round_began) * 1e6) if self.planner is not None else 0

    def _dylu_end(self, took: list[int], elapsed_us: list[int]) -> int:
        """Every worker's steps and time this round (the same on every process): recorded, and
        the next round planned; returns how far the schedule step advanced."""
        advance = self.planner.spend(sum(took))
        for w, (steps, us) in enumerate(zip(took, elapsed_us, strict=True)):
            if steps:  # (a timer that did not move: a microsecond, not a division by zero)
                self.planner.record(w, max(us, 1) / 1e6, steps)
        self._plan = self.planner.plan()
        return advance

    def _dylu_state(self) -> dict | None:
        return None if self.planner is None else self.planner.state_dict()

    def _load_dylu(self, state: dict | None) -> None:
        """A checkpoint's planner (its next plan follows); the round's clock starts again."""
        if self.planner is not None and state is not None:
            self.planner.load_state_dict(state)
            self._plan = self.planner.plan()
        self._round_began = self.timer()
