"""Runtimes: where workers compute and how messages and time move. Each keeps an `OuterSide`
(outer_side.py) and exposes the small interface below, which is all the training loop
(run/loop.py) and the summary (rundir/summary.py) use; they never ask which runtime they hold.

- `side`: the OuterSide (global parameters `side.model`, `version`, counters).
- `num_workers`, `is_main` (this process evaluates and writes the run directory).
- `sim_time_s`: the simulated clock, or None in real runtimes.
- sync: `round(active) -> RoundStats`; async: `step() -> Arrival | None` until `done`, with
  `at_boundary` (no grace group half-applied: the state can be saved) and `step_budget`.
- `summary_extras() -> dict`: runtime-specific fields of summary.json.
- `state_dict()` / `load_state_dict(state)`: {"outer": ..., "workers": [...], "runtime": {name: ...}}
  (and "dylu": the round planner's state, core/dylu.py, in sync DiLoCo with DyLU) — the one
  checkpoint layout; a runtime reads only its own entry under "runtime".
- `planner`: sync DiLoCo with DyLU's `RoundPlanner`, where the runtime has one; the loop then
  runs rounds until its budget is spent.
- `broadcast(obj)`: the main process's object on every process (identity in one process).
- `after_checkpoint()`: a checkpoint of `state_dict()` is durable (the server drops the log
  records it covers; a no-op elsewhere).
- `close(clean=True)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from diloco.config import TrainConfig
from diloco.core.outer_side import OuterSide


@dataclass
class RoundStats:
    """What one round did: per-worker losses and the cumulative communication counters."""

    version: int  # outer updates applied so far
    inner_step: int  # inner steps each worker has taken so far
    losses: list[float]  # mean training loss of each worker over the round
    lr: float  # inner lr of the round's last step
    bytes_sent: list[int] = field(default_factory=list)  # cumulative, per worker
    bytes_received: list[int] = field(default_factory=list)  # cumulative, per worker
    timing: dict[str, float] | None = None  # real runtimes: measured compute_s and comm_s of the round
    workers: list[int] | None = None  # whose `losses` these are (None: workers 0, 1, ...)
    steps: list[int] | None = None  # sync DiLoCo with DyLU: each worker's inner steps (None: H each)


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


def is_main_process(cfg: TrainConfig) -> bool:
    """The process that evaluates and reads and writes the run directory: the only one in the
    simulator, rank 0 under torchrun. Every runtime's `is_main` is this."""
    return cfg.runtime != "collective" or int(os.environ.get("RANK", "0")) == 0


class SideView:
    """The outer side's state under the names a library user reads (`trainer.model`, ...)."""

    side: OuterSide
    model = property(lambda self: self.side.model)
    params = property(lambda self: self.side.params)
    version = property(lambda self: self.side.version)
    bytes_sent = property(lambda self: self.side.bytes_sent)
    bytes_received = property(lambda self: self.side.bytes_received)
    codec = property(lambda self: self.side.codec)


class InProcess(SideView):
    """A runtime whose workers all answer to this process (the simulators): it is the main one,
    has nothing to broadcast, to add to the summary or to do after a checkpoint."""

    is_main = True

    def summary_extras(self) -> dict[str, Any]:
        return {}

    def after_checkpoint(self) -> None:
        pass

    def broadcast(self, obj: Any) -> Any:
        return obj


class Runtime(Protocol):
    side: OuterSide
    is_main: bool

    @property
    def num_workers(self) -> int: ...

    @property
    def sim_time_s(self) -> float | None: ...

    def summary_extras(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None: ...

    def broadcast(self, obj: Any) -> Any: ...

    def after_checkpoint(self) -> None: ...

    def close(self, *, clean: bool = True) -> None: ...
