"""The DiLoCo paper's claims (docs/method.md §1, issue 13) reproduced at CPU scale.

Every number comes from `diloco train` runs in subprocesses (`--threads 1 --procs 1`,
OMP_NUM_THREADS=1, `--jobs` of them at once), compared over `--seeds` seeds by the final
`val_loss` of summary.json (the whole validation split): mean, min and max, and the relative
difference to the part's baseline ((x − base) / base on the means, and per seed, paired).
Equal compute throughout: DiLoCo runs k workers × S inner steps each (`--steps` S, default 1000
= 20 rounds of H = 50); data parallel (`--method dp --workers k`) runs S steps of a k× batch;
`--method single` runs S steps. H sweeps keep S fixed (rounds = S / H). Unless a part tunes it,
the outer optimizer is the paper's Nesterov, lr 0.7, momentum 0.9.

Parts (`--part`, repeatable or a comma list; default all):

- `dp`: the headline. DiLoCo vs data parallel, k = 4 and 8, from scratch and warm-started
  (`--init-from` a `--method single` model pretrained for `--pretrain-steps` P with seed 1000 +
  seed, once per seed and model; fresh optimizer state, the inner warm-up as configured), with
  `--method single` for reference, and, warm-started, the serial reference: `--method single` for
  k × S steps (the compute and tokens of k workers, one step after another: what data parallel
  matches when its k× batch is below the critical batch size; `--serial-ks` limits it to some k:
  it is the longest run). Every arm is tuned by the same rules (issue 36): on the tuning seed
  (TUNE_SEED, 100) and the tuning split (`--tune-fraction` TUNE_FRACTION, held out of every run
  of the part; tuning runs `--eval-on tune`), data parallel and single over an inner-lr grid
  {5e-4, 1e-3, 2e-3, 4e-3} for each warm-up {30, 100} (the serial reference takes single's
  pick), DiLoCo at each H of `--dp-hs` (default 50) over the same inner-lr grid at the paper's
  outer lr 0.7 and single's warm-up, then over its outer-lr grid {0.3, 0.5, 0.7, 1.0}
  (`--lr-grid`) at its picked inner lr; each pick then runs on every reported seed. (Every tuned
  grid grows past an edge the best sits on, by ×1.4 or ÷1.4 at most twice, inner lr ×2 or ÷2 at
  most three times; `*_at_grid_edge` says when the best is still on the edge.) Before issue 36
  only DiLoCo's outer lr was tuned, on seed 0 and the reported split:
  reproduce_diloco_2026-12-01.json. `tuning` records the split, the seed, every grid and pick;
  `dp_tuned_final_val_loss`, `diloco_warm_vs_dp_tuned_gap` (k = 4), `diloco_warm_vs_dp_tuned_gap_k8`.
  Top-level fields (the headline k = 8; the same per k under `per_k`):
  `dp_final_val_loss` (data parallel, warm-started: the baseline of the warm comparison),
  `diloco_warm_final_val_loss`, `diloco_warm_vs_dp_gap` ((diloco − dp) / dp), `bytes_ratio_vs_dp`
  (dp's bytes sent per worker ÷ DiLoCo's), and the from-scratch equivalents
  `dp_scratch_final_val_loss`, `diloco_scratch_final_val_loss`, `diloco_scratch_vs_dp_gap`; per k
  also `serial_warm_final_val_loss` and `dp_warm_vs_serial_gap`, and what each arm gains over
  `single` at the same steps, (single − arm) / single: `dp_{start}_vs_single_gain`,
  `diloco_{start}_vs_single_gain`, with `diloco_{start}_share_of_dp_gain` DiLoCo's gain over
  data parallel's (the paper's, in log perplexity: 2.1% and 2.8%, a share above 1). Ablations,
  not picks: `single_lr_below` (from each start) and `dp_lr_below` (from scratch; DiLoCo's
  gap to each is its entry's `vs_single_lr_below` / `vs_dp_lr_below` and `_paired`), the
  baseline at the inner-lr grid point below its pick (÷2, the same warm-up) on the reported
  seeds (per k `{arm}_{start}_lr_below_final_val_loss`, `diloco_{start}_vs_{arm}_lr_below_gap`),
  which say how much a baseline's row owes to a pick next to an lr where runs stall; `stalls`
  applies the stall rule (a seed more than 5% above its arm's lowest) to every arm, and a
  DiLoCo arm with a stalled seed gets its own ablation below its pick (its entry's `lr_below`).
- `single`: DiLoCo k = 1 vs plain AdamW (`--method single`) at equal steps.
- `workers`: DiLoCo k ∈ {1, 2, 4, 8} at equal steps per worker (baseline k = 1).
- `H`: H ∈ {10, 25, 50, 100, 250} (`--hs` some of them), k = 4 (`--h-k` another k, with its own
  JSON, figure and wall time), loss and bytes sent (baseline H = 50; data parallel's bytes for
  reference).
- `outer`: Nesterov (momentum 0.9) vs SGD with momentum 0 (lr 1 is FedAvg) vs Adam (eps 0.1),
  k = 4, each at its best lr of a small grid on seed 0 ({0.3, 0.5, 0.7, 1.0}, {0.5, 1.0, 1.5},
  {0.03, 0.1, 0.3}), then every seed at that lr (baseline Nesterov).
- `shards`: `--shards genre` and `kmeans` vs `iid`, k = 4.
- `drop`: `--drop-prob` 0, 0.1, 0.3, 0.5, k = 4 (baseline 0), and 0 and 0.5 warm-started as in part dp
  (the paper dropped outer_grads of a pretrained model); 0 and 0.5 also with `--after-drop global`
  (the dropped worker goes back to the global parameters), with k = 8 (the paper's workers), and
  both; the paper's configuration, stated before it ran (DROP_PAPER: k = 8, warm, `--after-drop
  global`, 0 and 0.5), is `paper_configuration`, the rest ablations.
- `schedule`: `--workers-schedule` 0:4,0.5:8 / 0:8,0.5:4 / 0:1,0.5:8 / 0:8,0.5:1, each against a
  constant number of workers with the same total worker-steps (6 for 4↔8; 4.5 for 1↔8, where
  no integer matches: the baseline is then interpolated per seed between constant k = 4 and 5,
  and the JSON says so), and the two shapes of one total against each other.
- `codec`: outer_grads as int8 and fp4, each with and without `--error-feedback`, and half of
  each outer_grad pruned (top-k 0.5, with and without `--error-feedback`: the DiLoCo paper's
  pruning claim), vs fp32, k = 4.
- `H500`: the paper's headline interval: nano, warm, k = 4, H500_STEPS (10,000) steps per worker,
  DiLoCo at H = 50 and 500 (each its own inner-lr grid over part dp's DiLoCo pick ÷2, ×1, ×2 at
  part dp's DiLoCo outer lr, then its own outer-lr grid over that pick ÷1.4, ×1, ×1.4) against
  data parallel re-tuned at these steps around part dp's pick (inner lr ÷2, ×1, ×2 at its
  warm-up); also its own JSON
  (reproduce_diloco_H500.json: `h500_vs_dp_gap`, `h500_bytes_ratio_vs_dp`, `h50_vs_dp_gap`) and
  a figure of loss against outer rounds and steps (each arm's mean over the seeds, with their
  range); per H, the curves' `peak` above their start and the gap
  to data parallel at every evaluated step (`vs_dp_by_step`), which explain a miss by rounds; and
  a figure of the tuning picks' curves (reproduce_H500_tuning.png), drawn once every arm has picked.

Runs are cached: each run's folder under `--workdir` is named by a hash of its full command
(without `--out`, `--threads`, `--procs`; `--init-from` by the pretraining run's folder name,
`--config` by its text), and a finished run (summary.json) is reused, so parts can run one at
a time in separate invocations; a failed run (e.g. a diverged outer lr) keeps its `failed.json`
and counts as failed (the worst of a grid). Each run checkpoints every tenth of its rounds (every
round below 20 rounds; `--checkpoint-every`, not part of its name: a checkpoint changes no
result), so a run the lane was stopped in continues from its folder's latest checkpoint, bit for
bit, when the part runs again (its ledger row says `resumed`; its `elapsed_s` is the run's
summary `wall_time_s`, which counts the work before the checkpoint but not the work lost after
it); a resume that `diloco train` refuses (exit code 2) starts the run over; checkpoints are
deleted once a run has finished or failed. Move a lane's worktree to another commit only when
no folder holds a checkpoint, or to one that changes no result (a resume would mix two versions
of the code in one run). The folders (models, logs) are git-ignored and stay on the machine
that ran them, so every finished run's result
(summary.json, time, its evaluation curve) also goes to a ledger kept in git,
benchmarks/results/reproduce_ledger/runs.jsonl (one JSON object per run, sorted by name;
`--model micro`: reproduce_micro_ledger/; `--quick`: the workdir's _ledger/; `--ledger` another
folder), beside part_timing.json (each part's wall time over every invocation). A
run in the ledger is not run again on a new machine, except a pretraining run whose model a
new warm-started run needs: it runs again, and a result that differs from the ledger's is
reported (the runs are meant to be deterministic). The JSON always covers every part from the
runs in the workdir and the ledger (with `--h-k`, part H only; with an `--out` of another
name, the parts `--part` names only).
Prints one JSON object and saves it to benchmarks/results/reproduce_diloco.json
(`--quick`: reproduce_diloco_quick.json); figures go to docs/figures/reproduce_<part>.png
(`--quick`: the workdir's figures/; `--model micro`: reproduce_<part>_micro.png, its runs
in results/reproduce_micro_runs/ and its JSON reproduce_diloco_micro.json). An `--out` of
another name than the default's (which depends on `--model`, `--quick` and `--h-k`) reports and
draws only the parts `--part` names, each figure named with what the name adds to the
default's (`--out .../reproduce_diloco_k8.json`: reproduce_dp_k8.png; `--out mine.json`:
reproduce_dp_mine.png), so it leaves the default JSON's figures as they are; another model's
JSON name is refused. Progress: stderr.

    python benchmarks/reproduce_diloco.py --part dp            # the headline
    python benchmarks/reproduce_diloco.py --part H,codec --seeds 3
    python benchmarks/reproduce_diloco.py --part dp --model micro
    python benchmarks/reproduce_diloco.py --report-only        # rebuild the JSON and figures
    python benchmarks/reproduce_diloco.py --plot-only          # figures only
    python benchmarks/reproduce_diloco.py --part dp --pending  # what is left, and its run time
    bash benchmarks/reproduce_lane.sh LANE PYTHON --pending    # issue 36's lane: all four invocations
    python benchmarks/reproduce_diloco.py --quick              # a tiny model, a few minutes: plumbing

Rough durations, nano, --seeds 3, --jobs 2 on this 2-core machine, before issue 36's tuning rules
(its grids make part dp about twice as many runs, and part H500 ~28 h of run time; `--pending`
estimates what a lane has left from its ledger's times): an ESTIMATE, not measured end to end.
One nano run of 100 steps alone (1 thread) took ~117 ms per worker-step (data parallel ~110 ms
per worker's share of its k× batch) plus ~13 s per run (start-up ~3 s, evaluations); the
worker-steps of each part's runs were scaled by that and halved for two jobs (two jobs at once may
run somewhat slower). "Alone": the part by itself; "after": in the default order, where runs shared
with earlier parts (cached) are not run again.

    part       runs  worker-steps   alone    after
    dp          45      221k        3.7 h    3.7 h   (before issue 36: incl. 3 pretraining; 4-lr grid × 4)
    single       6        6k        0.1 h    0.05 h
    workers     15       48k        0.8 h    0.1 h
    H           18       71k        1.2 h    0.8 h
    outer       16       64k        1.1 h    0.7 h
    shards       9       36k        0.6 h    0.4 h
    drop        12       48k        0.8 h    0.6 h
    schedule    21      108k        1.8 h    1.6 h
    codec       15       60k        1.0 h    0.8 h
    all                             ~8.7 h

`--model micro` is ~4× slower per step (~480 ms): its `dp` part alone would take ~15 h. `--ks`,
`--starts` and `--lr-grid` narrow part dp (e.g. `--model micro --part dp --ks 4 --starts warm
--lr-grid 0.5,0.7,1 --steps 500`, about 1.7 h).
`--quick` (tiny model, 40 steps, every part, 3 seeds, 165 runs) took 4.3 minutes before issue 36;
`--quick --seeds 2 --part dp,drop,H500` under its rules ran 160 runs in 409 s.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "docs" / "figures"
sys.path.insert(0, str(ROOT / "src"))

MODELS = ("nano", "micro")
PARTS = ("dp", "single", "workers", "H", "outer", "shards", "drop", "schedule", "codec", "H500")
DP_KS = (4, 8)
OUTER_LR_GRID = (0.3, 0.5, 0.7, 1.0)
PAPER_OUTER_LR = 0.7  # the paper's outer lr: where DiLoCo's inner-lr grid runs (part dp)
GRID_STEP, GRID_WIDEN = 1.4, 2  # a tuned lr's grid grows past an edge by ×1.4 (÷1.4), at most twice
# The tuning rules of part dp and part H500 (issue 36): every arm picks its settings on a seed and
# a split that are never reported. The tuning split is the end of every work's training text
# (`--tune-fraction`), held out of every run of these parts, tuning or reported; tuning runs
# score it (`--eval-on tune`), reported runs the validation split as always.
TUNE_SEED = 100
TUNE_FRACTION = 0.05
INNER_LR_GRID, INNER_GRID_STEP = (5e-4, 1e-3, 2e-3, 4e-3), 2.0  # data parallel's and single's
# an inner-lr grid may grow past an edge three times (to 3.2e-2): data parallel at k = 4 was still
# improving at its second widening's 1.6e-2 (1.5155 at 8e-3, 1.5057 at 1.6e-2, tuning split)
INNER_WIDEN = 3
WARMUPS = (30, 100)  # their warm-up steps, each with its own inner-lr grid
# part dp's stall rule, stated before the micro model's runs from scratch: a reported seed stalls
# where its final val_loss is more than 5% above its arm's lowest seed (on nano, single's pick
# from scratch, +19% and +32%, and data parallel k = 8's, +13%, where every other arm's seeds
# lie within 2%); DiLoCo then gets the ablation one inner-lr grid point below its pick, as the
# baselines get theirs unconditionally
STALL_RATIO = 1.05
# `diloco train`'s inner lr and warm-up (InnerConfig), as DiLoCo ran before issue 36
DEFAULT_INNER = (1e-3, 30)
H500_STEPS, H500_HS = 10_000, (50, 500)
OUTER_GRIDS = {  # name -> (--outer-opt, --outer-momentum or None, lr grid)
    "nesterov": ("nesterov", None, OUTER_LR_GRID),
    "sgd": ("sgd", 0.0, (0.5, 1.0, 1.5)),
    "adam": ("adam", None, (0.03, 0.1, 0.3)),
}
WORKERS = (1, 2, 4, 8)
HS = (10, 25, 50, 100, 250)
DROP_PROBS = (0.0, 0.1, 0.3, 0.5)
DROP_PROBS_WARM = (0.0, 0.5)  # also with --after-drop global, and with DROP_K8 workers
DROP_K8 = 8
# The paper's configuration, stated before it ran (issue 36): 8 workers, a pretrained model, and
# every worker starting each round from the global parameters (its dropped outer_grad is simply
# not averaged), 0.5 against 0; the other drop sweeps are ablations.
DROP_PAPER = {"k": DROP_K8, "warm": True, "after": "global"}
SCHEDULES = {"4to8": "0:4,0.5:8", "8to4": "0:8,0.5:4", "1to8": "0:1,0.5:8", "8to1": "0:8,0.5:1"}
CODECS = {
    "fp32": [],
    "int8": ["--codec", "int8"],
    "int8_ef": ["--codec", "int8", "--error-feedback"],
    "fp4": ["--codec", "fp4"],
    "fp4_ef": ["--codec", "fp4", "--error-feedback"],
    # the DiLoCo paper's pruning claim: half of each outer_grad dropped costs ~0.4% (issue 35)
    "topk50": ["--codec", "topk", "--topk-fraction", "0.5"],
    "topk50_ef": ["--codec", "topk", "--topk-fraction", "0.5", "--error-feedback"],
}
K = 4  # workers of the parts that do not vary them
PRETRAIN_SEED = 1000  # the pretraining run of seed s uses seed 1000 + s (its own batch order)
QUICK_CONFIG = """\
# reproduce_diloco.py --quick: a tiny model that checks the plumbing
[model]
name = "nano"
n_layer = 2
n_head = 2
d_model = 32
seq_len = 32

[data]
batch_size = 4
"""
QUICK_STEPS, QUICK_H, QUICK_HS = 40, 10, (5, 10, 20, 40)


def _log(text: str) -> None:
    print(f"[reproduce] {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def _num(x: float) -> str:
    return f"{x:g}"


# -- runs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One `diloco train` run: its result-determining flags and the pretraining run it starts from."""

    name: str  # folder under the workdir: a readable slug and the hash of the command
    label: str
    seed: int
    flags: tuple[str, ...]
    init: Run | None = None


@dataclass
class Tuned:
    """An outer lr picked on the first seed from a grid (lowest final val_loss), then run on every
    seed. While the best lr sits on an edge of the grid, the grid grows past it one step (×/÷
    GRID_STEP) at a time, at most `widen` times: a grid the answer lies outside tunes nothing."""

    make: Callable[[float, int], Run]  # (lr, seed) -> run
    base: tuple[float, ...]
    seeds: list[int]
    tune: Callable[[float], Run] | None = None  # lr -> the grid's run (tuning seed and split), else seed 0
    step: float = GRID_STEP
    widen: int = GRID_WIDEN  # how many times the grid may grow past an edge

    def _grid_run(self, lr: float) -> Run:
        return self.tune(lr) if self.tune is not None else self.make(lr, self.seeds[0])

    def grid(self, ctx: Ctx) -> tuple[float, ...]:
        """The grid as far as the first seed's finished runs have widened it."""
        grid = list(self.base)
        for _ in range(self.widen):
            lr = self._best(ctx, grid)
            if lr is None or len(grid) < 2:
                break
            if lr == max(grid):
                grid.append(float(f"{max(grid) * self.step:.2g}"))
            elif lr == min(grid):
                grid.insert(0, float(f"{min(grid) / self.step:.2g}"))
            else:
                break
        return tuple(grid)

    def _best(self, ctx: Ctx, grid: list[float] | tuple[float, ...]) -> float | None:
        runs = [self._grid_run(lr) for lr in grid]
        if not all(ctx.finished(r) for r in runs):
            return None
        losses = [_loss(ctx.result(r)) for r in runs]
        ranked = [(v, lr) for lr, v in zip(grid, losses, strict=True) if v is not None]
        return min(ranked)[1] if ranked else None

    def grid_runs(self, ctx: Ctx) -> list[Run]:
        return [self._grid_run(lr) for lr in self.grid(ctx)]

    def table(self, ctx: Ctx) -> dict[str, float | None]:
        return {_num(lr): _loss(ctx.result(self._grid_run(lr))) for lr in self.grid(ctx)}

    def peaks(self, ctx: Ctx) -> dict[str, dict | None]:
        """Each grid run's `peak` (its evaluation curve's highest point after the start)."""
        return {_num(lr): peak(*ctx.curve(self._grid_run(lr).name)) for lr in self.grid(ctx)}

    def best_loss(self, ctx: Ctx) -> float | None:
        """The grid's best loss (the tuning split's, for a grid with `tune`)."""
        lr = self.best(ctx)
        return None if lr is None else _loss(ctx.result(self._grid_run(lr)))

    def best(self, ctx: Ctx) -> float | None:
        """The best lr once the (widened) grid has finished (failed runs count as worst), else None."""
        return self._best(ctx, self.grid(ctx))

    def at_edge(self, ctx: Ctx) -> bool | None:
        """Whether the best lr is still the grid's smallest or largest after widening."""
        lr, grid = self.best(ctx), self.grid(ctx)
        return None if lr is None else lr in (min(grid), max(grid))

    def runs(self, ctx: Ctx) -> list[Run]:
        lr = self.best(ctx)
        return [] if lr is None else [self.make(lr, s) for s in self.seeds]

    def best_run(self, ctx: Ctx) -> Run | None:
        """The grid's run at the best lr (the tuning seed's, for a grid with `tune`)."""
        lr = self.best(ctx)
        return None if lr is None else self._grid_run(lr)


@dataclass
class Choice:
    """The best of several tuned grids (data parallel's and single's: one inner-lr grid per
    warm-up), by their best tuning loss; it waits for every grid. Scheduled like a `Tuned`."""

    options: dict[str, Tuned]  # label (e.g. "warmup 30") -> its grid

    def grid_runs(self, ctx: Ctx) -> list[Run]:
        return [r for t in self.options.values() for r in t.grid_runs(ctx)]

    def pick(self, ctx: Ctx) -> str | None:
        """The option whose best tuning loss is lowest, once every grid has finished (an option
        whose runs all failed drops out); None before."""
        if any(not all(ctx.finished(r) for r in t.grid_runs(ctx)) for t in self.options.values()):
            return None
        losses = {name: t.best_loss(ctx) for name, t in self.options.items()}
        ranked = [(v, name) for name, v in losses.items() if v is not None]
        return min(ranked)[1] if ranked else None

    def runs(self, ctx: Ctx) -> list[Run]:
        name = self.pick(ctx)
        return [] if name is None else self.options[name].runs(ctx)

    def report(self, ctx: Ctx) -> dict:
        name = self.pick(ctx)
        t = self.options.get(name) if name else None
        return {
            "grids": {n: o.table(ctx) for n, o in self.options.items()},
            "pick": name,
            "lr": t.best(ctx) if t else None,
            "lr_at_grid_edge": t.at_edge(ctx) if t else None,
        }


@dataclass
class Follow:
    """Runs at a `Choice`'s pick once it is known (the serial reference at single's; a baseline's
    ablation one grid point below its own). Scheduled like a `Tuned`."""

    source: Choice
    make: Callable[[float, int], list[Run]]  # runs at the source's (inner lr, warm-up)

    def grid_runs(self, ctx: Ctx) -> list[Run]:
        return self.source.grid_runs(ctx)

    def runs(self, ctx: Ctx) -> list[Run]:
        picked = _picked(self.source, ctx)
        return [] if picked is None else self.make(*picked)


class Centred:
    """A grid made once another arm's pick is known (`inner`, None before): scheduled like a
    `Tuned`, its source's grid first."""

    source: Choice | Tuned

    def inner(self, ctx: Ctx) -> Tuned | None:
        raise NotImplementedError

    def grid_runs(self, ctx: Ctx) -> list[Run]:
        t = self.inner(ctx)
        return self.source.grid_runs(ctx) + (t.grid_runs(ctx) if t else [])

    def runs(self, ctx: Ctx) -> list[Run]:
        t = self.inner(ctx)
        return t.runs(ctx) if t else []

    def best(self, ctx: Ctx) -> float | None:
        t = self.inner(ctx)
        return t.best(ctx) if t else None

    def at_edge(self, ctx: Ctx) -> bool | None:
        t = self.inner(ctx)
        return t.at_edge(ctx) if t else None

    def table(self, ctx: Ctx) -> dict[str, float | None]:
        t = self.inner(ctx)
        return t.table(ctx) if t else {}


def _nearest(grid: tuple[float, ...], x: float) -> float:
    """The grid's value nearest `x` (the smaller of two as near)."""
    return min(grid, key=lambda v: (abs(v - x), v))


def _around(x: float, step: float) -> tuple[float, ...]:
    """A grid of three centred on `x`: ÷step, ×1, ×step (two significant digits)."""
    return (float(f"{x / step:.2g}"), x, float(f"{x * step:.2g}"))


@dataclass
class Around(Centred):
    """An inner-lr grid centred on another arm's pick (×/÷ INNER_GRID_STEP, at its warm-up), made
    once the pick is known: part H500's data parallel re-tunes around part dp's pick at its own
    steps, as its DiLoCo arms re-tune theirs. Scheduled like a `Tuned`."""

    source: Choice
    make: Callable[[float, int, int], Run]  # (lr, warmup, seed) -> a reported run
    tune: Callable[[float, int], Run]  # (lr, warmup) -> a tuning run
    seeds: list[int]

    def inner(self, ctx: Ctx) -> Tuned | None:
        picked = _picked(self.source, ctx)
        if picked is None:
            return None
        lr, w = picked
        return Tuned(
            functools.partial(lambda lr, s, w: self.make(lr, w, s), w=w),
            _around(lr, INNER_GRID_STEP),
            self.seeds,
            tune=functools.partial(lambda lr, w: self.tune(lr, w), w=w),
            step=INNER_GRID_STEP,
            widen=INNER_WIDEN,
        )

    def report(self, ctx: Ctx) -> dict:
        t = self.inner(ctx)
        return {
            "around": self.source.report(ctx),
            "grid": t.table(ctx) if t else None,
            "lr": t.best(ctx) if t else None,
            "warmup": _picked(self.source, ctx)[1] if t else None,
            "lr_at_grid_edge": t.at_edge(ctx) if t else None,
        }


@dataclass
class Diloco(Centred):
    """DiLoCo's two lrs, tuned one after the other on the tuning seed and split: its inner lr over
    a grid at a fixed outer lr, then its outer lr over a grid at that pick (one pass of coordinate
    steps; each grid widens at an edge like any `Tuned`; the outer grid's point at the fixed outer
    lr is the inner grid's pick, one run). Part dp (`source` single's Choice): the inner grid
    INNER_LR_GRID at the outer grid's point nearest the paper's outer lr (PAPER_OUTER_LR: 0.7 of
    the default --lr-grid), the outer grid `outer_base` (--lr-grid), at single's picked warm-up.
    Part H500 (`source` part dp's DiLoCo arm): both grids centred on that arm's picks, the inner
    one at its outer pick. Scheduled like a `Tuned`; its `inner` is the outer-lr grid, the one
    run on the seeds."""

    source: Choice | Diloco
    make: Callable[[float, float, int, int], Run]  # (outer lr, inner lr, warm-up, seed) -> a reported run
    tune: Callable[[float, float, int], Run]  # (outer lr, inner lr, warm-up) -> a tuning run
    seeds: list[int]
    outer_base: tuple[float, ...] = OUTER_LR_GRID  # part dp's outer grid (centred in part H500)

    def _centres(self, ctx: Ctx) -> tuple[tuple[float, ...], float, int, tuple[float, ...]] | None:
        """(inner grid, the outer lr it runs at, warm-up, outer grid), once the source has picked."""
        if isinstance(self.source, Choice):
            picked = _picked(self.source, ctx)
            if picked is None:
                return None
            return INNER_LR_GRID, _nearest(self.outer_base, PAPER_OUTER_LR), picked[1], self.outer_base
        settings, outer = self.source.picked(ctx), self.source.best(ctx)
        if settings is None or outer is None:
            return None
        ilr, w = settings
        return _around(ilr, INNER_GRID_STEP), outer, w, _around(outer, GRID_STEP)

    def inner_grid(self, ctx: Ctx) -> Tuned | None:
        """The inner-lr grid (a grid only), once the source has picked."""
        c = self._centres(ctx)
        if c is None:
            return None
        base, outer, w, _ = c
        return Tuned(
            lambda ilr, s: self.make(outer, ilr, w, s),
            base,
            [],
            tune=lambda ilr: self.tune(outer, ilr, w),
            step=INNER_GRID_STEP,
            widen=INNER_WIDEN,
        )

    def picked(self, ctx: Ctx) -> tuple[float, int] | None:
        """DiLoCo's (inner lr, warm-up), once its inner-lr grid has finished."""
        g = self.inner_grid(ctx)
        ilr = g.best(ctx) if g else None
        return None if ilr is None else (ilr, self._centres(ctx)[2])

    def inner(self, ctx: Ctx) -> Tuned | None:
        picked = self.picked(ctx)
        if picked is None:
            return None
        ilr, w = picked
        base = self._centres(ctx)[3]
        return Tuned(
            lambda lr, s: self.make(lr, ilr, w, s), base, self.seeds, tune=lambda lr: self.tune(lr, ilr, w)
        )

    def grid_runs(self, ctx: Ctx) -> list[Run]:
        g, t = self.inner_grid(ctx), self.inner(ctx)
        return self.source.grid_runs(ctx) + (g.grid_runs(ctx) if g else []) + (t.grid_runs(ctx) if t else [])

    def report(self, ctx: Ctx) -> dict:
        c, g, t = self._centres(ctx), self.inner_grid(ctx), self.inner(ctx)
        picked = self.picked(ctx)
        return {
            "inner_grid": g.table(ctx) if g else None,
            "inner_grid_at_outer_lr": c[1] if c else None,
            "inner_lr": picked[0] if picked else None,
            "warmup": c[2] if c else None,
            "inner_lr_at_grid_edge": g.at_edge(ctx) if g else None,
            "grid": t.table(ctx) if t else None,
            "pick": t.best(ctx) if t else None,
            "lr_at_grid_edge": t.at_edge(ctx) if t else None,
        }


@dataclass
class IfStalled:
    """Part dp's stall rule for DiLoCo: once its reported seeds have all run, if one stalled
    (`_stalled`), the arm one inner-lr grid point below its pick (÷2, at its outer lr and
    warm-up) on the same seeds; nothing otherwise. Scheduled like a `Tuned` whose grid is the
    arm's grids and reported runs (so DiLoCo's reported seeds go first of their kind, before the
    baselines' seeds: the ablation waits for them)."""

    arm: Diloco

    def grid_runs(self, ctx: Ctx) -> list[Run]:
        return self.arm.grid_runs(ctx) + self.arm.runs(ctx)

    def settings(self, ctx: Ctx) -> tuple[float, float, int] | None:
        """(outer lr, inner lr, warm-up) of the ablation, once the rule gives one; None before."""
        reported = self.arm.runs(ctx)
        if not reported or not all(ctx.finished(r) for r in reported) or not _stalled(entry(ctx, reported)):
            return None
        ilr, w = self.arm.picked(ctx)
        return self.arm.best(ctx), _lr_below(ilr), w

    def runs(self, ctx: Ctx) -> list[Run]:
        at = self.settings(ctx)
        return [] if at is None else [self.arm.make(*at, s) for s in self.arm.seeds]


@dataclass
class Plan:
    """What one part runs: fixed runs, and tuned ones whose other seeds wait for the grid."""

    runs: list[Run] = field(default_factory=list)
    tuned: list[Tuned | Choice | Follow | Around | Diloco] = field(default_factory=list)
    later: list[Run] = field(default_factory=list)  # references, run after the others of their kind
    # the part's own runs, where its plan also holds the runs it starts from (another part's picks)
    owns: Callable[[Run], bool] | None = None

    def all_runs(self, ctx: Ctx) -> list[Run]:
        out = list(self.runs) + list(self.later)
        for t in self.tuned:
            out += t.grid_runs(ctx) + t.runs(ctx)
        out += [r.init for r in out if r.init is not None]
        return list({r.name: r for r in out}.values())


def _loss(res: dict | None) -> float | None:
    if not res or res.get("failed"):
        return None
    v = res.get("val_loss")
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


class Ledger:
    """Every finished run's result in one file kept in git, one JSON object per line sorted by
    run name: `summary` (summary.json), `elapsed_s`, `curve` (the evaluations on the fixed subset,
    [inner_step, val_loss]) or, for a failed run, `failed` (failed.json). Rows written by hand
    say so in `source`."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        self._dirty = False
        self._lock = threading.Lock()
        if path.is_file():
            for i, line in enumerate(path.read_text().splitlines(), 1):
                try:
                    row = json.loads(line) if line.strip() else None
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{i}: not a JSON object ({e}); fix or delete that line") from e
                if row is not None:
                    self.rows[row["name"]] = row

    def put(self, row: dict) -> None:
        """Adds or replaces a row, unless only its `recorded` time would change."""
        with self._lock:
            old = self.rows.get(row["name"])
            if old is None or {**old, "recorded": None} != {**row, "recorded": None}:
                self.rows[row["name"]] = row
                self._dirty = True

    def save(self) -> None:
        """Rewrites the file whole (a temporary file renamed over it) when a row changed."""
        with self._lock:
            if not self._dirty:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(
                "".join(json.dumps(self.rows[n], sort_keys=True) + "\n" for n in sorted(self.rows))
            )
            os.replace(tmp, self.path)
            self._dirty = False


class Ctx:
    """The settings every run shares, how runs are named, found and started."""

    def __init__(self, args: argparse.Namespace):
        self.quick = args.quick
        self.dp_ks = tuple(args.ks)  # part dp's k, starts and outer lr grid (smaller for micro)
        self.dp_starts = tuple(args.starts)
        self.dp_lr_grid = tuple(args.lr_grid)
        self.dp_hs = tuple(getattr(args, "dp_hs", None) or (args.H,))  # part dp's DiLoCo H values
        self.h500_steps, self.h500_hs = (
            (2 * QUICK_STEPS, (QUICK_H, 2 * QUICK_H)) if args.quick else (H500_STEPS, H500_HS)
        )
        self.serial_ks = tuple(args.ks if args.serial_ks is None else args.serial_ks)
        self.model = args.model
        self.steps = args.steps
        self.H = args.H
        self.hs = args.hs
        self.h_k = args.h_k  # part H's workers
        self.seeds = list(range(args.seeds))
        self.pretrain_steps = args.pretrain_steps
        self.jobs = args.jobs
        self.workdir: Path = args.workdir
        self.config_text = QUICK_CONFIG if self.quick else ""
        self.config_path = self.workdir / "quick.toml"
        self.ledger = Ledger(args.ledger)
        self._results: dict[str, dict | None] = {}
        self.rerun: set[str] = set()  # runs the ledger has but that run again (a row without a curve)

    # naming and flags
    def make(self, slug: str, label: str, seed: int, flags: list, init: Run | None = None) -> Run:
        flags_t = tuple(str(f) for f in flags)
        payload = json.dumps(
            {"flags": flags_t, "init": init.name if init else None, "config": self.config_text},
            sort_keys=True,
        )
        digest = hashlib.sha256(payload.encode()).hexdigest()[:12]
        return Run(f"{slug}-{digest}", label, seed, flags_t, init)

    def common(self, seed: int) -> list:
        return ["--seed", seed] + ([] if self.quick else ["--model", self.model])

    def eval_every(self, H: int, steps: int | None = None) -> list:
        """About 20 evaluations on the fixed subset per run, at a multiple of H."""
        every = H * max(1, ((steps or self.steps) // 20) // H)
        return [] if every == H else ["--eval-every", every]

    def pretrain(self, seed: int, fair: bool = False) -> Run:
        """The warm start of seed `seed`; `fair`: without the tuning split (parts dp, H500)."""
        H = self.H
        flags = [*self.common(PRETRAIN_SEED + seed), "--method", "single"]
        flags += ["--inner-steps", H, "--rounds", self.pretrain_steps // H, *self.fair(fair)]
        label = f"pretrain single {self.pretrain_steps} steps seed {PRETRAIN_SEED + seed}"
        return self.make(f"pretrain-s{seed}", label + (" fair" if fair else ""), seed, flags)

    def _start(self, seed: int, warm: bool, fair: bool = False) -> tuple[Run | None, str]:
        return (self.pretrain(seed, fair), " warm") if warm else (None, "")

    @staticmethod
    def fair(fair: bool, tuning: bool = False) -> list:
        """The flags of the tuning rules: every run holds the tuning split out; tuning runs score it."""
        return (["--tune-fraction", _num(TUNE_FRACTION)] if fair else []) + (
            ["--eval-on", "tune"] if tuning else []
        )

    @staticmethod
    def _inner(lr: float | None, warmup: int | None) -> tuple[list, str]:
        """Inner-optimizer flags and label of a tuned run (None: the default)."""
        flags = (["--inner-lr", _num(lr)] if lr is not None else []) + (
            ["--warmup-steps", warmup] if warmup is not None else []
        )
        label = f" lr={_num(lr)}" if lr is not None else ""
        label += f" wu={warmup}" if warmup is not None else ""
        return flags, label

    def single(
        self,
        seed: int,
        warm: bool = False,
        steps: int | None = None,
        *,
        fair: bool = False,
        tuning: bool = False,
        lr: float | None = None,
        warmup: int | None = None,
    ) -> Run:
        """Plain AdamW for `steps` (default --steps); k × --steps is the serial reference of
        part dp: the compute and tokens of k workers, one step after another."""
        init, tag = self._start(seed, warm, fair)
        n = steps or self.steps
        inner, note = self._inner(lr, warmup)
        flags = [*self.common(seed), "--method", "single", "--inner-steps", self.H]
        flags += ["--rounds", n // self.H, *self.eval_every(self.H, n), *inner, *self.fair(fair, tuning)]
        slug, label = ("single", "single") if n == self.steps else (f"single{n}", f"single {n} steps")
        tag += " tune" if tuning else ""
        return self.make(f"{slug}-s{seed}", f"{label}{note}{tag} s{seed}", seed, flags, init)

    def dp(
        self,
        k: int,
        seed: int,
        warm: bool = False,
        *,
        fair: bool = False,
        tuning: bool = False,
        lr: float | None = None,
        warmup: int | None = None,
        steps: int | None = None,
    ) -> Run:
        init, tag = self._start(seed, warm, fair)
        n = steps or self.steps
        inner, note = self._inner(lr, warmup)
        flags = [*self.common(seed), "--method", "dp", "--workers", k, "--inner-steps", self.H]
        flags += ["--rounds", n // self.H, *self.eval_every(self.H, n), *inner, *self.fair(fair, tuning)]
        slug = f"dp-k{k}" if n == self.steps else f"dp{n}-k{k}"
        tag += " tune" if tuning else ""
        steps_note = "" if n == self.steps else f" {n} steps"
        return self.make(f"{slug}-s{seed}", f"dp k={k}{steps_note}{note}{tag} s{seed}", seed, flags, init)

    def diloco(
        self,
        seed: int,
        *,
        k: int = K,
        H: int | None = None,
        lr: float = 0.7,
        opt: str = "nesterov",
        momentum: float | None = None,
        warm: bool = False,
        extra: tuple = (),
        note: str = "",
        fair: bool = False,
        tuning: bool = False,
        steps: int | None = None,
        inner_lr: float | None = None,
        warmup: int | None = None,
    ) -> Run:
        H = H or self.H
        n = steps or self.steps
        init, tag = self._start(seed, warm, fair)
        # the defaults' runs (before issue 36's grids) keep their names, and so their results
        if (inner_lr, warmup) == DEFAULT_INNER:
            inner_lr = warmup = None
        inner, inner_note = self._inner(inner_lr, warmup)
        note = (f" inner{inner_note}" if inner_note else "") + note
        flags = [*self.common(seed), "--method", "diloco", "--workers", k, "--inner-steps", H]
        flags += ["--rounds", n // H, "--outer-opt", opt, "--outer-lr", _num(lr)]
        if momentum is not None:
            flags += ["--outer-momentum", _num(momentum)]
        flags += [*self.eval_every(H, n), *inner, *extra, *self.fair(fair, tuning)]
        label = f"diloco k={k} H={H} {opt} lr={_num(lr)}" + (
            f" m={_num(momentum)}" if momentum is not None else ""
        )
        slug = f"diloco-k{k}-H{H}" if n == self.steps else f"diloco{n}-k{k}-H{H}"
        label += "" if n == self.steps else f" {n} steps"
        tag += " tune" if tuning else ""
        return self.make(f"{slug}-s{seed}", f"{label}{note}{tag} s{seed}", seed, flags, init)

    # results
    def dir(self, run: Run) -> Path:
        return self.workdir / run.name

    def done_share(self, run: Run) -> float:
        """The share of an unfinished run its folder's latest checkpoint holds (0 without one):
        a resume continues from there, so `--pending` counts only the rest."""
        from diloco.rundir import checkpoint

        saved = checkpoint.rounds(self.dir(run) / "checkpoints")
        if not saved or (self.dir(run) / "failed.json").exists():
            return 0.0
        total = int(run.flags[run.flags.index("--rounds") + 1]) if "--rounds" in run.flags else 1
        return min(1.0, saved[-1] / total)

    def finished(self, run: Run, model: bool = False) -> bool:
        """Its folder has a result, or the ledger has one; `model`: a model to start from is needed
        (only the folder has it), unless the run failed."""
        d = self.dir(run)
        if (
            (d / "failed.json").is_file()
            or (d / "summary.json").is_file()
            and (d / "model.safetensors").is_file()
        ):
            return True
        if run.name in self.rerun:
            return False
        row = self.ledger.rows.get(run.name)
        return row is not None and (not model or "failed" in row)

    def result(self, run: Run) -> dict | None:
        """summary.json plus the measured subprocess time; {"failed": ...} for a failed run; from
        the run's folder, else from the ledger."""
        if run.name in self._results:
            return self._results[run.name]
        d = self.dir(run)
        res: dict | None = None
        if (d / "failed.json").is_file():
            res = {"failed": True, **json.loads((d / "failed.json").read_text())}
        elif (d / "summary.json").is_file():
            res = json.loads((d / "summary.json").read_text())
            bench = d / "bench.json"
            record = json.loads(bench.read_text()) if bench.is_file() else {}
            res["elapsed_s"] = record.get("elapsed_s")
            if record.get("resumed"):
                res["resumed"] = True
        elif (row := self.ledger.rows.get(run.name)) is not None:
            res = {"failed": True, **row["failed"]} if "failed" in row else {**row["summary"]}
            res.setdefault("elapsed_s", row.get("elapsed_s"))
        if res is not None:
            self._results[run.name] = res
        return res

    def evals(self, name: str) -> list[dict] | None:
        """A run's evaluations on the fixed subset (metrics.jsonl's records), None without a folder
        that has a metrics.jsonl."""
        path = self.workdir / name / "metrics.jsonl"
        if not path.is_file():
            return None
        evals = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return [e for e in evals if e.get("kind") == "eval" and e.get("split", "subset") == "subset"]

    def curve(self, name: str) -> tuple[list[int], list[float]]:
        """The evaluations on the fixed subset of a run: from its metrics.jsonl, else the ledger."""
        evals = self.evals(name)
        if evals is None:
            row = self.ledger.rows.get(name) or {}
            points = row.get("curve") or []
            return [int(x) for x, _ in points], [None if y is None else float(y) for _, y in points]
        return [e["inner_step"] for e in evals], [e["val_loss"] for e in evals]

    def keep(self, run: Run) -> None:
        """Copies a finished run's folder result into the ledger (saved by `ledger.save`); says so
        when the folder's val_loss differs from a row already there (a run that is not
        deterministic, e.g. a pretraining run made again on another machine)."""
        d = self.dir(run)
        if not ((d / "failed.json").is_file() or (d / "summary.json").is_file()):
            return
        shutil.rmtree(d / "checkpoints", ignore_errors=True)  # a run that ended needs none
        self._results.pop(run.name, None)
        res = dict(self.result(run) or {})
        old = self.ledger.rows.get(run.name)
        row: dict = {"name": run.name, "label": run.label, "flags": list(run.flags)}
        row["init"] = run.init.name if run.init else None
        if res.pop("failed", False):
            if run.name in self.rerun and old is not None and "failed" not in old:
                _log(f"NOTE {run.label} [{run.name}]: its run again failed; the ledger keeps its row")
                return
            row["failed"] = {k: v for k, v in res.items() if k != "cmd"}
        else:
            row["elapsed_s"] = res.pop("elapsed_s", None)
            if res.pop("resumed", False):
                row["resumed"] = True  # continued from a checkpoint (elapsed_s: over its attempts)
            res.pop("run_dir", None)  # the machine's path
            row["summary"] = res
            xs, ys = self.curve(run.name)
            row["curve"] = [[x, round(y, 5)] for x, y in zip(xs, ys, strict=True)]
            was = _loss((old or {}).get("summary"))
            if was is not None and abs(round(res["val_loss"], 5) - round(was, 5)) > 1e-5:
                _log(
                    f"NOTE {run.label} [{run.name}]: val_loss {res['val_loss']:.5f} here, "
                    f"{was:.5f} in the ledger ({old.get('source', 'an earlier run')}): not deterministic"
                )
        row["recorded"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.ledger.put(row)

    def command(self, run: Run, resume: bool = False, stop_after: int | None = None) -> list[str]:
        """The run's `diloco train`; it checkpoints every tenth of its rounds (a checkpoint
        changes no result: the run's name ignores it), so a lane stopped mid-run continues it
        (`resume`: from the folder's latest checkpoint, bit for bit) instead of starting over.
        `stop_after`: a checkpoint after that round, then stop (benchmarks/h500_outer_step.py)."""
        cmd = [sys.executable, "-m", "diloco", "train"]
        tail = ["--threads", "1", "--procs", "1", "--no-progress"]
        tail += [] if stop_after is None else ["--stop-after", str(stop_after)]
        if resume:
            return cmd + ["--resume", str(self.dir(run)), *tail]
        if self.quick:
            cmd += ["--config", str(self.config_path)]
        cmd += list(run.flags)
        if run.init is not None:
            cmd += ["--init-from", str(self.dir(run.init))]
        rounds = int(run.flags[run.flags.index("--rounds") + 1])
        cmd += ["--checkpoint-every", str(max(1, rounds // 10)), "--keep-checkpoints", "1"]
        return cmd + ["--out", str(self.dir(run)), *tail]

    def train(self, run: Run) -> tuple[bool, float]:
        """Run one `diloco train` (in a worker thread); its folder gets bench.json or failed.json.
        A folder an interrupted attempt left with a checkpoint is resumed from it; a resume that
        `diloco train` refuses (exit code 2: the checkpoint cannot be read) starts the run over,
        while a resumed run that fails in training (3) is a failed run. A finished or failed run's
        checkpoints are deleted."""
        d = self.dir(run)
        resume = not (d / "failed.json").exists() and any((d / "checkpoints").glob("round-[0-9]*"))
        if resume:
            _log(f"resume {run.label} [{run.name}] from its folder's latest checkpoint")
        proc, elapsed = self._attempt(run, resume)
        refused = None
        if resume and proc.returncode == 2:
            refused = {"returncode": 2, "stderr_tail": proc.stderr[-1000:]}
            why = proc.stderr.strip().splitlines()[-1:] or ["no message"]
            _log(f"{run.label} [{run.name}]: its resume was refused ({why[0]}); it starts over")
            resume = False
            proc, elapsed = self._attempt(run, resume)
        d.mkdir(parents=True, exist_ok=True)
        record = {"label": run.label, "cmd": self.command(run), "elapsed_s": elapsed}
        record["returncode"] = proc.returncode
        if refused:
            record["resume_refused"] = refused
        ok = proc.returncode == 0 and (d / "summary.json").is_file()
        if resume:
            # the run's wall time over its attempts: its summary counts the work before the
            # checkpoint too (not the work an interrupted attempt lost after it)
            record["resumed"] = {"cmd": self.command(run, True), "attempt_elapsed_s": elapsed}
            if ok:
                wall = json.loads((d / "summary.json").read_text()).get("wall_time_s") or 0.0
                record["elapsed_s"] = round(max(elapsed, wall), 2)
        if not ok:
            record["stderr_tail"] = proc.stderr[-3000:]
        (d / ("bench.json" if ok else "failed.json")).write_text(json.dumps(record, indent=2) + "\n")
        self.keep(run)
        self.ledger.save()
        return ok, record["elapsed_s"]

    def _attempt(
        self, run: Run, resume: bool, stop_after: int | None = None
    ) -> tuple[subprocess.CompletedProcess, float]:
        """One `diloco train` process (afresh in an emptied folder unless `resume`; up to round
        `stop_after` if given); `Stopped` when a signal stopped it."""
        if not resume:
            shutil.rmtree(self.dir(run), ignore_errors=True)  # an earlier attempt without a checkpoint
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        cmd = self.command(run, resume, stop_after)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        elapsed = round(time.perf_counter() - t0, 2)
        if proc.returncode in STOPPED:  # the lane was stopped: no result (a crash, -6 or -11, is one)
            why = (
                " (SIGKILL: kill -9, a session's end, or the kernel out of memory)"
                if proc.returncode == -9
                else ""
            )
            raise Stopped(f"{run.label} was stopped (exit code {proc.returncode}){why}: not recorded")
        return proc, elapsed


# Ctrl-C (diloco train's own exit code, or the signal), SIGTERM, SIGHUP, SIGKILL: a lane's run
# killed by a signal is stopped, not failed (a failed run counts as the worst of its grid, so a
# run that a session's end killed would bias a tuning pick); the rare kill for memory shows as
# the lane stopping again at the same run.
STOPPED = (130, -2, -15, -1, -9)


class Stopped(Exception):
    """A run's process was killed by a signal: nothing is recorded, and a restart runs it again."""


class Scheduler:
    """Runs the parts' runs, `jobs` at a time: a warm-started run after its pretraining run, the
    other seeds of a tuned lr after the first seed's grid. Parts go in order, and within a part
    pretraining runs first, then warm-started runs (the issue's target), then the rest (references
    in `Plan.later` last of their kind), a tuned grid's runs (a widened one's too) first of their
    kind: their results are what the runs waiting for a pick wait for; a slot a part cannot fill
    (its last run, or runs waiting for a grid) goes to the next part's runs. A run two parts
    share belongs to the first."""

    TICK_S = 60.0  # how often a part with a run in flight records its elapsed time

    def __init__(self, ctx: Ctx, record: Callable[[str, float, int], None]):
        self.ctx = ctx
        # (part, seconds from its first start to its latest finish, or to now while a run of it is
        # in flight, runs done): recorded each TICK_S too, so a lane killed at a session's end has
        # counted its part's time up to the last tick, not only up to its last finish
        self.record = record

    def execute(self, plans: dict[str, Plan]) -> int:
        ctx = self.ctx
        pending: list[Run] = []
        part_of: dict[str, str] = {}
        order = {p: i for i, p in enumerate(plans)}
        inits: set[str] = set()
        later = {r.name for plan in plans.values() for r in plan.later}
        grids: set[str] = set()  # the tuned grids' runs

        def key(x: Run) -> tuple:  # part, then pretraining / warm-started / the rest, references last
            kind = 0 if x.name in inits else 1 if x.init else 2
            return order[part_of[x.name]], kind, x.name in later, x.name not in grids

        def add(part: str, runs: list[Run], grid: bool = False) -> None:
            grids.update(r.name for r in runs if grid)
            for r in runs:
                if r.name in part_of:
                    continue
                part_of[r.name] = part
                if ctx.finished(r):
                    continue
                pending.append(r)
                i = r.init  # its pretraining run, again if only the ledger has it (no model)
                if i is not None and i.name not in inits:
                    inits.add(i.name)
                    part_of.setdefault(i.name, part)
                    if not ctx.finished(i, model=True):
                        pending.append(i)
            pending.sort(key=key)

        for part, plan in plans.items():
            add(part, plan.runs)
            for t in plan.tuned:
                add(part, t.grid_runs(ctx), grid=True)
            add(part, plan.later)
        waiting = [(part, t) for part, plan in plans.items() for t in plan.tuned]
        running: dict[Future, Run] = {}
        first_start: dict[str, float] = {}
        done_in: dict[str, int] = {}
        self.stopped = stopped = False  # a run was killed by a signal: start no more, let the others finish
        with ThreadPoolExecutor(max_workers=ctx.jobs) as pool:
            while (pending or running or waiting) and not (stopped and not running):
                for part, t in list(waiting):
                    grid = t.grid_runs(ctx)
                    add(part, grid, grid=True)  # a grid widened past an edge: its new lr
                    # done once every grid run has finished and the grid, read again, is the same:
                    # a run finishing while the grid is read may widen it (runs finish in threads)
                    if all(ctx.finished(r) for r in grid) and t.grid_runs(ctx) == grid:
                        waiting.remove((part, t))
                        add(part, t.runs(ctx))
                for r in list(pending):
                    if len(running) >= ctx.jobs or stopped:
                        break
                    if r.init is not None and not ctx.finished(r.init, model=True):
                        continue
                    pending.remove(r)
                    part = part_of[r.name]
                    if r.init is not None and _loss(ctx.result(r.init)) is None:
                        _log(f"skip {r.label}: its pretraining run failed")
                        continue
                    tuning = any(p == part for p, _ in waiting)
                    queued = sum(1 for x in pending if part_of[x.name] == part)
                    _log(
                        f"{part}: start {r.label} [{r.name}] "
                        f"({queued} queued{', more after tuning' if tuning else ''})"
                    )
                    first_start.setdefault(part, time.perf_counter())
                    running[pool.submit(ctx.train, r)] = r
                if not running:
                    if pending or waiting:  # only runs whose pretraining run cannot finish
                        _log(f"{len(pending)} runs cannot start; giving up on them")
                    break
                finished, _ = wait(list(running), timeout=self.TICK_S, return_when=FIRST_COMPLETED)
                for fut in finished:
                    r = running.pop(fut)
                    part = part_of[r.name]
                    try:
                        ok, elapsed = fut.result()
                    except Stopped as e:
                        _log(f"{part}: {e}; starting nothing more (run the part again to redo it)")
                        self.stopped = stopped = True
                        continue
                    done_in[part] = done_in.get(part, 0) + 1
                    span = time.perf_counter() - first_start[part]
                    self.record(part, span, done_in[part])
                    res = ctx.result(r)
                    what = f"val_loss {res['val_loss']:.4f}" if ok and res else "FAILED (see failed.json)"
                    left = sum(1 for x in [*pending, *running.values()] if part_of[x.name] == part)
                    tuning = any(p == part for p, _ in waiting)
                    _log(
                        f"{part}: done {r.label}: {what}, {elapsed:.0f} s; part elapsed {span:.0f} s, "
                        f"{done_in[part]} done, {left} left{' + tuned runs' if tuning else ''}"
                    )
                for part in dict.fromkeys(part_of[r.name] for r in running.values()):  # in flight
                    self.record(part, time.perf_counter() - first_start[part], done_in.get(part, 0))
        return sum(done_in.values())


# -- statistics ---------------------------------------------------------------------------------
def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {
        "mean": round(statistics.fmean(values), 5),
        "min": round(min(values), 5),
        "max": round(max(values), 5),
        "n": len(values),
    }


def entry(ctx: Ctx, runs: list[Run], **meta) -> dict:
    """A comparison's row: the final val_loss over seeds, bytes, steps and the runs behind it."""
    per_seed, bytes_, steps, missing, failed = {}, [], [], [], []
    for r in runs:
        res = ctx.result(r)
        v = _loss(res)
        if res is None:
            missing.append(r.name)
        elif v is None:
            failed.append(r)
        else:
            per_seed[str(r.seed)] = round(v, 5)
            bytes_.append(res["bytes_sent_per_worker"])
            steps.append(res["inner_steps"])
    out = {
        **meta,
        "val_loss": _stats(list(per_seed.values())),
        "per_seed": per_seed,
        "bytes_sent_per_worker": round(statistics.fmean(bytes_)) if bytes_ else None,
        "worker_steps": round(statistics.fmean(steps)) if steps else None,
        "runs": [r.name for r in runs],
    }
    if missing:
        out["missing"] = missing
    if failed:
        out["failed"] = [r.name for r in failed]
        out["failed_seeds"] = [str(r.seed) for r in failed]
    return out


def mean(e: dict | None) -> float | None:
    return e["val_loss"]["mean"] if e and e.get("val_loss") else None


def gains(single: dict | None, dp: dict | None, diloco: dict | None) -> tuple[float | None, ...]:
    """(data parallel's, DiLoCo's) gain over one worker at the same steps, (single − arm) / single
    on the means, and DiLoCo's gain as a share of data parallel's (the paper, in log perplexity:
    2.1% and 2.8%, a share above 1). None where an arm has not run; a share only where data
    parallel gains."""
    m_single, m_dp, m_di = mean(single), mean(dp), mean(diloco)
    if m_single is None:
        return None, None, None
    dp_gain = None if m_dp is None else round((m_single - m_dp) / m_single, 6)
    di_gain = None if m_di is None else round((m_single - m_di) / m_single, 6)
    share = None
    if m_dp is not None and m_di is not None and m_single > m_dp:
        share = round((m_single - m_di) / (m_single - m_dp), 4)
    return dp_gain, di_gain, share


def versus(e: dict, base: dict | None, key: str = "vs_baseline") -> dict:
    """Adds the relative difference to `base`: on the means, and per seed (paired)."""
    m, b = mean(e), mean(base)
    e[key] = round((m - b) / b, 6) if m is not None and b is not None else None
    mine, theirs = e.get("per_seed") or {}, (base or {}).get("per_seed") or {}
    e[f"{key}_paired"] = _stats([(v - theirs[s]) / theirs[s] for s, v in mine.items() if s in theirs])
    return e


def versus_ppl(e: dict, base: dict | None) -> dict:
    """Adds the difference to `base` in perplexity, per seed (paired): exp(loss − base's loss) − 1,
    the paper's measure, which unlike a relative loss does not depend on the loss's level."""
    mine, theirs = e.get("per_seed") or {}, (base or {}).get("per_seed") or {}
    e["vs_baseline_ppl_paired"] = _stats(
        [math.exp(v - theirs[s]) - 1 for s, v in mine.items() if s in theirs]
    )
    return e


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _curve_band(ctx: Ctx, runs: list[str]) -> tuple[list[int], list[float], list[float], list[float]]:
    """The runs' evaluation curves at the steps all of them evaluated: the steps, and at each the
    mean, the lowest and the highest of the runs (a run without a curve, or with an evaluation
    that is not a number, gives none)."""
    curves = [dict(zip(*ctx.curve(name), strict=True)) for name in runs]
    if (
        not curves
        or not all(curves)
        or any(not (isinstance(v, float) and math.isfinite(v)) for c in curves for v in c.values())
    ):
        return [], [], [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    at = [[c[x] for c in curves] for x in steps]
    return steps, [statistics.fmean(v) for v in at], [min(v) for v in at], [max(v) for v in at]


def _mean_curve(ctx: Ctx, runs: list[str]) -> tuple[list[int], list[float]]:
    """The runs' evaluation curves averaged at the steps all of them evaluated (`_curve_band`'s mean)."""
    xs, ys, _, _ = _curve_band(ctx, runs)
    return xs, ys


def peak(xs: list[int], ys: list[float]) -> dict | None:
    """A curve's highest evaluation after its first (the start): where it is (`step`), what it
    is (`val_loss`) and how far above the start (`vs_start`, negative for a curve that only
    falls); None for a curve of fewer than two evaluations or one with a value not a number."""
    if len(ys) < 2 or any(not (isinstance(y, float) and math.isfinite(y)) for y in ys):
        return None
    i = max(range(1, len(ys)), key=lambda j: ys[j])  # the first of equal highs
    return {"step": xs[i], "val_loss": round(ys[i], 5), "vs_start": round(ys[i] / ys[0] - 1, 4)}


def gap_by_step(ctx: Ctx, dp: dict, e: dict) -> dict[str, float] | None:
    """DiLoCo's mean evaluation curve against data parallel's at each step both evaluated after
    the start (relative, as `vs_dp`): how the gap moves with outer rounds. None when either has
    no whole curve."""
    xs, ys = _mean_curve(ctx, dp.get("runs") or [])
    mx, my = _mean_curve(ctx, e.get("runs") or [])
    if not xs or not mx:
        return None
    theirs = dict(zip(xs, ys, strict=True))
    pairs = [(x, y) for x, y in zip(mx, my, strict=True) if x and x in theirs]
    return {str(x): round((y - theirs[x]) / theirs[x], 4) for x, y in pairs}


def per_round(lo: tuple[int, list[int], list[float]], hi: tuple[int, list[int], list[float]]) -> dict | None:
    """Two H values' curves (each `(H, steps, val_losses)`) compared round for round, i.e. at equal
    bytes: after the larger H's last round, where each is (`val_loss_hi`, `val_loss_lo`) and the
    smaller H's relative to the larger's (`lo_vs_hi`), and the rounds after which the smaller H's
    curve first reaches the larger's final evaluation (`lo_rounds_to_reach_hi`, interpolated; None
    if it never does) and their ratio to the larger's rounds. None without both curves or when the
    smaller H has no evaluation after that many rounds, or a curve holds a value not a number."""
    (h_lo, xs_lo, ys_lo), (h_hi, xs_hi, ys_hi) = lo, hi
    finite = all(isinstance(y, float) and math.isfinite(y) for y in (*ys_lo, *ys_hi))
    if not xs_lo or not xs_hi or not finite:
        return None
    rounds = xs_hi[-1] // h_hi
    at = dict(zip(xs_lo, ys_lo, strict=True)).get(rounds * h_lo)
    if at is None:
        return None
    reach = steps_to_reach(xs_lo, ys_lo, ys_hi[-1])
    return {
        "rounds": rounds,
        "val_loss_hi": round(ys_hi[-1], 5),
        "val_loss_lo": round(at, 5),
        "lo_vs_hi": round(at / ys_hi[-1] - 1, 4),
        "lo_rounds_to_reach_hi": None if reach is None else round(reach / h_lo, 1),
        "lo_rounds_ratio": None if reach is None else round(reach / h_lo / rounds, 2),
    }


def steps_to_reach(xs: list[int], ys: list[float], target: float) -> float | None:
    """The step at which a curve first gets down to `target`, by linear interpolation between
    its evaluations; None if it never does."""
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if y <= target:
            if i == 0 or ys[i - 1] == y:
                return float(x)
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (x - x0) * (y0 - target) / (y0 - y)
    return None


def dp_steps_to_match(ctx: Ctx, dp: dict, e: dict, steps: int) -> tuple[float | None, str | None]:
    """The share of data parallel's steps after which its evaluation curve (mean over the seeds,
    fixed subset) reaches where DiLoCo's ends: DiLoCo's compute counted in data parallel's; both
    run `steps` per worker. With None, why: data parallel never gets there, or a run is missing,
    failed or has no whole curve."""
    if dp.get("missing") or e.get("missing") or dp.get("failed") or e.get("failed"):
        return None, "a run is missing or failed"
    xs, ys = _mean_curve(ctx, dp.get("runs") or [])
    mx, my = _mean_curve(ctx, e.get("runs") or [])
    if not xs or not mx or xs[-1] != steps or mx[-1] != steps:
        return None, "no whole evaluation curve for every run"
    at = steps_to_reach(xs, ys, my[-1])
    if at is None:
        return None, "never: DiLoCo ends below data parallel's curve"
    return round(at / xs[-1], 4), None


def _with_match(ctx: Ctx, dp: dict, e: dict, steps: int) -> None:
    """Sets `dp_steps_to_match` on a DiLoCo entry, and `dp_steps_to_match_why` when it is None."""
    e["dp_steps_to_match"], why = dp_steps_to_match(ctx, dp, e, steps)
    if why:
        e["dp_steps_to_match_why"] = why


# -- the parts: each builds its plan and its report from the same runs ------------------------
def _inner_choice(ctx: Ctx, make: Callable[..., Run]) -> Choice:
    """Data parallel's or single's tuning: an inner-lr grid per warm-up on the tuning seed and
    split, the best of them run on every seed. `make(seed, tuning, lr, warmup)` makes a run."""
    return Choice(
        {
            f"warmup {w}": Tuned(
                functools.partial(lambda lr, s, w: make(s, False, lr, w), w=w),
                INNER_LR_GRID,
                ctx.seeds,
                tune=functools.partial(lambda lr, w: make(TUNE_SEED, True, lr, w), w=w),
                step=INNER_GRID_STEP,
                widen=INNER_WIDEN,
            )
            for w in WARMUPS
        }
    )


def _picked(choice: Choice, ctx: Ctx) -> tuple[float, int] | None:
    """The (inner lr, warm-up) a Choice picked."""
    name = choice.pick(ctx)
    return None if name is None else (choice.options[name].best(ctx), int(name.split()[-1]))


def dp_arms(ctx: Ctx, k: int, warm: bool) -> tuple[Choice, Choice, dict[int, Diloco]]:
    """Part dp's tuned arms at (k, start): single, data parallel, and DiLoCo at each --dp-hs (its
    inner-lr grid at the paper's outer lr and single's warm-up, then its outer-lr grid)."""
    single = _inner_choice(ctx, lambda s, t, lr, w: ctx.single(s, warm, fair=True, tuning=t, lr=lr, warmup=w))
    dp = _inner_choice(ctx, lambda s, t, lr, w: ctx.dp(k, s, warm, fair=True, tuning=t, lr=lr, warmup=w))

    def run(seed: int, tuning: bool, H: int, lr: float, ilr: float, w: int) -> Run:
        return ctx.diloco(seed, k=k, H=H, lr=lr, warm=warm, fair=True, tuning=tuning, inner_lr=ilr, warmup=w)

    diloco = {
        H: Diloco(
            single,
            functools.partial(lambda lr, ilr, w, s, H: run(s, False, H, lr, ilr, w), H=H),
            functools.partial(lambda lr, ilr, w, H: run(TUNE_SEED, True, H, lr, ilr, w), H=H),
            ctx.seeds,
            ctx.dp_lr_grid,
        )
        for H in ctx.dp_hs
    }
    return single, dp, diloco


def ablations(
    ctx: Ctx, k: int, warm: bool, H: int, single: Choice, arm: Diloco
) -> dict[str, dict[str, float]]:
    """DiLoCo's outer-lr grids under the rules issue 36 tried before (never run now; as far as the
    ledger has them, on the tuning seed and split): at the default inner lr 1e-3, warm-up 30 (the
    first rule), and at single's picked inner lr and warm-up (stop 64's). Only their runs that
    are not also runs of the arm's own grids (`arm`: the current rule) are listed, and none at the
    arm's own picked inner settings: what is listed fed no pick."""
    settings = {"inner lr 1e-3 wu 30": DEFAULT_INNER}
    if (picked := _picked(single, ctx)) is not None:
        settings[f"single's inner lr {_num(picked[0])} wu {picked[1]}"] = picked
    own = {r.name for r in arm.grid_runs(ctx)}
    out, seen = {}, {arm.picked(ctx)}
    for name, (ilr, w) in settings.items():
        if (ilr, w) in seen:
            continue
        seen.add((ilr, w))
        old = Tuned(
            lambda lr, s: None,  # a grid only
            ctx.dp_lr_grid,
            [],
            tune=lambda lr, ilr=ilr, w=w: ctx.diloco(
                TUNE_SEED, k=k, H=H, lr=lr, warm=warm, fair=True, tuning=True, inner_lr=ilr, warmup=w
            ),
        )
        runs = {_num(lr): old.tune(lr) for lr in old.grid(ctx)}  # as far as the ledger widened it
        table = {lr: _loss(ctx.result(r)) for lr, r in runs.items() if r.name not in own}
        if table := {lr: v for lr, v in table.items() if v is not None}:
            out[f"diloco k={k} H={H} {'warm' if warm else 'scratch'}, {name}"] = table
    return out


def _below(ctx: Ctx, t: Follow) -> dict:
    """An ablation's entry: its runs (one inner-lr grid point below the source's pick) with that
    lr and warm-up; no settings while the source has not picked."""
    at = _picked(t.source, ctx)
    return entry(ctx, t.runs(ctx), **({} if at is None else {"lr": _lr_below(at[0]), "warmup": at[1]}))


def _lr_below(lr: float) -> float:
    """The inner-lr grid point below `lr`, rounded as a widened grid's points are."""
    return float(f"{lr / INNER_GRID_STEP:.2g}")


def _stalled(e: dict | None) -> list[str]:
    """The seeds of an entry more than STALL_RATIO above its lowest (none with fewer than two),
    and those whose run failed (diverged: the worst stall)."""
    per_seed = (e or {}).get("per_seed") or {}
    low = min(per_seed.values()) if per_seed else None
    high = [s for s, v in per_seed.items() if len(per_seed) > 1 and v > STALL_RATIO * low]
    return sorted(high + list((e or {}).get("failed_seeds") or []), key=int)


def _stalls(per_k: dict) -> dict:
    """Part dp's stall rule applied to every arm of `per_k`: the arms with a stalled seed, and the
    DiLoCo arms among them that the rule gives an ablation below their pick."""
    seeds: dict[str, list[str]] = {}
    for k, row in per_k.items():
        for start in ("scratch", "warm"):
            r = row.get(start)
            if not r:
                continue
            arms = {
                f"single {start}": r.get("single"),
                f"single {start} lr_below": r.get("single_lr_below"),
                f"dp k={k} {start}": r.get("dp"),
                f"dp k={k} {start} lr_below": r.get("dp_lr_below"),
                f"serial k={k} {start}": r.get("serial"),
                **{f"diloco k={k} H={H} {start}": e for H, e in r["diloco_by_H"].items()},
                **{
                    f"diloco k={k} H={H} {start} lr_below": e.get("lr_below")
                    for H, e in r["diloco_by_H"].items()
                },
            }
            seeds.update({arm: got for arm, e in arms.items() if (got := _stalled(e))})
    return {
        "rule": f"a reported seed stalls where its final val_loss is more than "
        f"{round(100 * (STALL_RATIO - 1))}% above its arm's lowest seed; a DiLoCo arm with one gets "
        "the ablation one inner-lr grid point below its pick",
        "seeds": seeds,
        "diloco_needs_ablation": [arm for arm in seeds if arm.startswith("diloco") and "lr_below" not in arm],
    }


def part_dp(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    """DiLoCo vs data parallel, every arm tuned by the tuning rules (TUNE_SEED, TUNE_FRACTION)."""
    plan = Plan()
    arms: dict[tuple[int, bool], tuple[Choice, Choice, dict[int, Diloco]]] = {}
    serial: dict[int, Follow] = {}
    # ablations, not picks: a baseline one inner-lr grid point below its pick on the reported
    # seeds; single from each start (one Follow for every k), data parallel from scratch (where
    # a pick can keep a run on the loss plateau), keyed by (arm, k, warm)
    below: dict[tuple[str, int, bool], Follow] = {}
    stall: dict[tuple[int, bool, int], IfStalled] = {}  # (k, warm, H): the stall rule's

    def single_below(lr: float, w: int, warm: bool) -> list[Run]:
        return [ctx.single(s, warm, fair=True, lr=_lr_below(lr), warmup=w) for s in ctx.seeds]

    def dp_below(lr: float, w: int, k: int, warm: bool) -> list[Run]:
        return [ctx.dp(k, s, warm, fair=True, lr=_lr_below(lr), warmup=w) for s in ctx.seeds]

    starts = [start == "warm" for start in ctx.dp_starts]
    for warm in sorted(starts, reverse=True):  # warm first: the issue's target
        for k in ctx.dp_ks:
            arms[k, warm] = dp_arms(ctx, k, warm)
            single, dp, diloco = arms[k, warm]
            plan.tuned += [dp, *diloco.values()] + ([single] if k == ctx.dp_ks[0] else [])
        follows = [Follow(arms[ctx.dp_ks[0], warm][0], functools.partial(single_below, warm=warm))]
        below.update({("single", k, warm): follows[0] for k in ctx.dp_ks})
        if not warm:
            for k in ctx.dp_ks:
                below["dp", k, warm] = Follow(arms[k, warm][1], functools.partial(dp_below, k=k, warm=warm))
                follows.append(below["dp", k, warm])
        plan.tuned += follows
        for k in ctx.dp_ks:  # the stall rule's ablation below DiLoCo's pick, where it gives one
            for H, arm in arms[k, warm][2].items():
                stall[k, warm, H] = IfStalled(arm)
                plan.tuned.append(stall[k, warm, H])
        if warm:  # the serial reference: one worker, k × the steps, at single's tuned settings

            def make(lr: float, w: int, k: int) -> list[Run]:
                n = k * ctx.steps
                return [ctx.single(s, True, steps=n, fair=True, lr=lr, warmup=w) for s in ctx.seeds]

            for k in ctx.serial_ks:
                serial[k] = Follow(arms[ctx.dp_ks[0], True][0], functools.partial(make, k=k))
            plan.tuned += list(serial.values())

    def report() -> dict:
        fair_pre = entry(ctx, [ctx.pretrain(s, True) for s in ctx.seeds], steps=ctx.pretrain_steps)
        out: dict = {"k": list(ctx.dp_ks), "starts": list(ctx.dp_starts), "H": ctx.H, "steps": ctx.steps}
        out["hs"] = list(ctx.dp_hs)
        out["pretrain_steps"] = ctx.pretrain_steps
        out["outer_lr_grid"] = list(ctx.dp_lr_grid)
        out["pretrain"] = fair_pre
        tuning: dict = {
            "split": f"--tune-fraction {_num(TUNE_FRACTION)}: the last {_num(TUNE_FRACTION)} of every work's "
            "training text, held out of every run of this part; tuning runs score it (--eval-on tune), "
            "reported runs the validation split",
            "seed": TUNE_SEED,
            "reported_seeds": list(ctx.seeds),
            "inner_lr_grid": list(INNER_LR_GRID),
            "warmups": list(WARMUPS),
            "outer_lr_grid": list(ctx.dp_lr_grid),
            "widening": "a grid whose best is on an edge grows past it (inner lr "
            f"×/÷{_num(INNER_GRID_STEP)} at most {INNER_WIDEN} times, outer lr ×/÷{_num(GRID_STEP)} at most "
            f"{GRID_WIDEN} times)",
            "diloco_inner": "DiLoCo's inner lr over the inner-lr grid at outer lr "
            f"{_num(_nearest(ctx.dp_lr_grid, PAPER_OUTER_LR))} (the outer-lr grid's point nearest the "
            f"paper's {_num(PAPER_OUTER_LR)}) and single's picked warm-up, then its outer lr over the "
            "outer-lr grid at that inner lr (their shared point one run)",
            "arms": {},
            "ablations": {},
        }
        per_k = {}
        for k in ctx.dp_ks:
            row: dict = {}
            for warm in sorted(starts):
                start = "warm" if warm else "scratch"
                single_t, dp_t, diloco_t = arms[k, warm]
                dp = entry(ctx, dp_t.runs(ctx), **(dp_t.report(ctx)))
                single = versus(entry(ctx, single_t.runs(ctx), **single_t.report(ctx)), dp, "vs_dp")
                lower = {  # the ablations below a pick
                    arm: versus(_below(ctx, below[arm, k, warm]), dp, "vs_dp")
                    for arm in ("single", "dp")
                    if (arm, k, warm) in below
                }
                tuning["arms"][f"dp k={k} {start}"] = dp_t.report(ctx)
                tuning["arms"][f"single {start}"] = single_t.report(ctx)
                ser = None
                if warm and k in serial:
                    ser = versus(entry(ctx, serial[k].runs(ctx)), dp, "vs_dp")
                by_H = {}
                for H, t in diloco_t.items():
                    lr = t.best(ctx)
                    di = entry(ctx, t.runs(ctx), outer_lr=lr, H=H) if lr is not None else {"val_loss": None}
                    if lr is not None:
                        versus(di, dp, "vs_dp")
                        _with_match(ctx, dp, di, ctx.steps)
                    if at := stall[k, warm, H].settings(ctx):  # the stall rule gave it an ablation
                        lower_di = entry(
                            ctx, stall[k, warm, H].runs(ctx), outer_lr=at[0], lr=at[1], warmup=at[2]
                        )
                        di["lr_below"] = versus(lower_di, dp, "vs_dp")
                    di["outer_lr_at_grid_edge"] = t.at_edge(ctx)
                    di["lr_grid_tuning"] = t.table(ctx)
                    picked = t.picked(ctx)
                    di["inner_lr"], di["warmup"] = picked if picked else (None, None)
                    tuning["arms"][f"diloco k={k} H={H} {start}"] = t.report(ctx)
                    tuning["ablations"].update(ablations(ctx, k, warm, H, single_t, t))
                    by_H[str(H)] = di
                head = by_H.get(str(ctx.H)) or next(iter(by_H.values()))
                row[start] = {
                    "single": single,
                    **{f"{arm}_lr_below": e for arm, e in lower.items()},
                    **({"serial": ser} if ser is not None else {}),
                    "dp": dp,
                    "diloco": head,
                    "diloco_by_H": by_H,
                    "diloco_outer_lr": head.get("outer_lr"),
                    "diloco_outer_lr_at_grid_edge": head.get("outer_lr_at_grid_edge"),
                }
                row[f"dp_{start}_final_val_loss"] = mean(dp)
                row[f"diloco_{start}_final_val_loss"] = mean(head)
                row[f"single_{start}_final_val_loss"] = mean(single)
                for arm, e in lower.items():
                    row[f"{arm}_{start}_lr_below_final_val_loss"] = mean(e)
                for arm in lower:  # DiLoCo against the ablations below the baselines' picks
                    versus(head, lower[arm], f"vs_{arm}_lr_below")
                    row[f"diloco_{start}_vs_{arm}_lr_below_gap"] = head[f"vs_{arm}_lr_below"]
                if ser is not None:
                    row[f"serial_{start}_final_val_loss"] = mean(ser)
                    m_dp, m_serial = mean(dp), mean(ser)
                    row[f"dp_{start}_vs_serial_gap"] = (
                        round((m_dp - m_serial) / m_serial, 6) if m_dp and m_serial else None
                    )
                (
                    row[f"dp_{start}_vs_single_gain"],
                    row[f"diloco_{start}_vs_single_gain"],
                    row[f"diloco_{start}_share_of_dp_gain"],
                ) = gains(single, dp, head)
                row[f"diloco_{start}_vs_dp_gap"] = head.get("vs_dp")
                row[f"diloco_{start}_vs_dp_gap_paired"] = head.get("vs_dp_paired")
                row[f"diloco_{start}_dp_steps_to_match"] = head.get("dp_steps_to_match")
                for H, di in by_H.items():
                    row[f"diloco_{start}_H{H}_vs_dp_gap"] = di.get("vs_dp")
                    row[f"diloco_{start}_H{H}_dp_steps_to_match"] = di.get("dp_steps_to_match")
                    row[f"bytes_ratio_vs_dp_{start}_H{H}"] = ratio(
                        dp.get("bytes_sent_per_worker"), di.get("bytes_sent_per_worker")
                    )
                row[f"bytes_ratio_vs_dp_{start}"] = ratio(
                    dp.get("bytes_sent_per_worker"), head.get("bytes_sent_per_worker")
                )
            row["dp_final_val_loss"] = row.get("dp_warm_final_val_loss")
            row["bytes_ratio_vs_dp"] = row.get("bytes_ratio_vs_dp_warm")
            gap, br = row.get("diloco_warm_vs_dp_gap"), row["bytes_ratio_vs_dp"]
            row["target_warm_within_1pct_at_50x_fewer_bytes"] = (
                None if gap is None or br is None else bool(gap <= 0.01 and br >= 50)
            )
            per_k[str(k)] = row
        head_k = str(max(ctx.dp_ks))
        out["headline_k"] = int(head_k)
        keys = (
            "dp_final_val_loss",
            "diloco_warm_final_val_loss",
            "diloco_warm_vs_dp_gap",
            "bytes_ratio_vs_dp",
            "single_warm_final_val_loss",
            "dp_scratch_final_val_loss",
            "diloco_scratch_final_val_loss",
            "diloco_scratch_vs_dp_gap",
            "single_scratch_final_val_loss",
            "target_warm_within_1pct_at_50x_fewer_bytes",
        )
        out.update({key: per_k[head_k].get(key) for key in keys})
        k4, k8 = per_k.get("4", {}), per_k.get("8", {})
        out["dp_tuned_final_val_loss"] = k4.get("dp_warm_final_val_loss")
        out["diloco_warm_vs_dp_tuned_gap"] = k4.get("diloco_warm_vs_dp_gap")
        out["diloco_warm_vs_dp_tuned_gap_k8"] = k8.get("diloco_warm_vs_dp_gap")
        out["stalls"] = _stalls(per_k)
        out["tuning"] = tuning
        out["note"] = (
            "every arm tuned by the same rules (`tuning`): settings picked on the tuning seed and "
            "split, then run on the reported seeds and scored on the validation split; "
            "dp_final_val_loss is data parallel warm-started from the same pretrained model as "
            "diloco_warm; gaps are (diloco - dp) / dp on the means over seeds (_paired: per seed); "
            "bytes_ratio_vs_dp = dp bytes sent per worker / DiLoCo's; dp_steps_to_match = the share "
            "of data parallel's steps after which its evaluation curve (mean over seeds) reaches "
            "DiLoCo's final evaluation (when null, dp_steps_to_match_why says why). Before issue 36 only "
            "DiLoCo's outer lr was tuned, on seed 0 and the reported split: reproduce_diloco_2026-12-01.json"
        )
        out["per_k"] = per_k
        return out

    return plan, report


def part_single(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    single = [ctx.single(s) for s in ctx.seeds]
    k1 = [ctx.diloco(s, k=1) for s in ctx.seeds]

    def report() -> dict:
        base = entry(ctx, single)
        return {
            "baseline": "single",
            "single": base,
            "diloco_k1": versus(entry(ctx, k1, outer_lr=0.7), base),
            "claim": "DiLoCo k=1 beats plain AdamW a little (vs_baseline < 0)",
        }

    return Plan(single + k1), report


def part_workers(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    runs = {k: [ctx.diloco(s, k=k) for s in ctx.seeds] for k in WORKERS}
    single = [ctx.single(s) for s in ctx.seeds]

    def report() -> dict:
        base = entry(ctx, runs[WORKERS[0]], k=WORKERS[0])
        rows = {str(k): versus(entry(ctx, r, k=k), base) for k, r in runs.items()}
        return {
            "baseline": f"diloco k={WORKERS[0]}",
            "steps_per_worker": ctx.steps,
            "outer_lr": 0.7,
            "by_workers": rows,
            "single": versus(entry(ctx, single), base),
        }

    return Plan([*single, *(r for rs in runs.values() for r in rs)]), report


def part_H(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    runs = {h: [ctx.diloco(s, k=ctx.h_k, H=h) for s in ctx.seeds] for h in ctx.hs}
    dp = [ctx.dp(ctx.h_k, s) for s in ctx.seeds]

    def report() -> dict:
        base = entry(ctx, runs[ctx.H], H=ctx.H)
        dp_e = entry(ctx, dp)
        rows = {}
        for h, r in runs.items():
            e = versus(entry(ctx, r, H=h, rounds=ctx.steps // h), base)
            versus(e, dp_e, "vs_dp")
            e["bytes_ratio_vs_dp"] = ratio(dp_e["bytes_sent_per_worker"], e["bytes_sent_per_worker"])
            rows[str(h)] = e
        return {
            "baseline": f"H={ctx.H}",
            "k": ctx.h_k,
            "steps_per_worker": ctx.steps,
            "outer_lr": 0.7,
            "by_H": rows,
            "dp": dp_e,
        }

    return Plan([*dp, *(x for r in runs.values() for x in r)]), report


def part_outer(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    tuned = {}
    for name, (opt, momentum, grid) in OUTER_GRIDS.items():
        make = functools.partial(
            lambda lr, s, opt, m: ctx.diloco(s, lr=lr, opt=opt, momentum=m), opt=opt, m=momentum
        )
        tuned[name] = Tuned(make, grid, ctx.seeds)

    def report() -> dict:
        rows = {}
        for name, t in tuned.items():
            lr = t.best(ctx)
            e = (
                entry(ctx, t.runs(ctx), outer_lr=lr)
                if lr is not None
                else {"val_loss": None, "outer_lr": None}
            )
            opt, momentum, grid = OUTER_GRIDS[name]
            e.update(
                opt=opt, momentum=momentum, lr_grid_seed0=t.table(ctx), outer_lr_at_grid_edge=t.at_edge(ctx)
            )
            rows[name] = e
        base = rows["nesterov"]
        for e in rows.values():
            versus(e, base)
        return {
            "baseline": "nesterov",
            "k": K,
            "H": ctx.H,
            "by_optimizer": rows,
            "fedavg_seed0_val_loss": rows["sgd"]["lr_grid_seed0"].get("1"),
            "note": "sgd has momentum 0 (lr 1 is FedAvg); adam has eps 0.1; each at its best lr of the "
            "grid on seed 0",
        }

    return Plan(tuned=list(tuned.values())), report


def part_shards(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    kinds = ("iid", "genre", "kmeans")

    def run(kind: str, s: int) -> Run:  # iid is the default: the same run as the other parts' k = 4
        return ctx.diloco(s) if kind == "iid" else ctx.diloco(s, extra=("--shards", kind), note=f" {kind}")

    runs = {kind: [run(kind, s) for s in ctx.seeds] for kind in kinds}

    def report() -> dict:
        base = entry(ctx, runs["iid"])
        return {
            "baseline": "iid",
            "k": K,
            "by_shards": {kind: versus(entry(ctx, r), base) for kind, r in runs.items()},
        }

    return Plan([x for r in runs.values() for x in r]), report


def part_drop(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    def run(p: float, s: int, warm: bool = False, k: int = K, after: str = "own") -> Run:
        extra, note = (), ""
        if p:  # no drops: the same run whatever --after-drop would say
            extra, note = ("--drop-prob", _num(p)), f" drop {_num(p)}"
            if after != "own":
                extra, note = (*extra, "--after-drop", after), f"{note} after-drop {after}"
        return ctx.diloco(s, k=k, extra=extra, note=note, warm=warm)

    def sweep(probs: tuple[float, ...], **kw) -> dict[float, list[Run]]:
        return {p: [run(p, s, **kw) for s in ctx.seeds] for p in probs}

    runs = sweep(DROP_PROBS)
    # the paper drops outer_grads of a pretrained model: the same from part dp's warm start
    warm = sweep(DROP_PROBS_WARM, warm=True)
    # why 50% costs more here: the paper's 8 workers (a round is lost whole less often), and a
    # dropped worker going back to the global parameters instead of going on from its own
    rejoin = sweep(DROP_PROBS_WARM, after="global")
    k8 = sweep(DROP_PROBS_WARM, k=DROP_K8)
    k8_rejoin = sweep(DROP_PROBS_WARM, k=DROP_K8, after="global")
    paper = sweep(DROP_PROBS_WARM, k=DROP_PAPER["k"], warm=DROP_PAPER["warm"], after=DROP_PAPER["after"])

    def report() -> dict:
        def rows(by_p: dict[float, list[Run]], **meta) -> dict:
            base = entry(ctx, by_p[0.0])
            return {
                _num(p): versus_ppl(versus(entry(ctx, r, drop_prob=p, **meta), base), base)
                for p, r in by_p.items()
            }

        return {
            "baseline": "drop_prob 0",
            "k": K,
            "after_drop": "own",
            "by_drop_prob": rows(runs),
            "by_drop_prob_warm": rows(warm),
            "by_drop_prob_after_global": rows(rejoin, after_drop="global"),
            f"by_drop_prob_k{DROP_K8}": rows(k8, k=DROP_K8),
            f"by_drop_prob_k{DROP_K8}_after_global": rows(k8_rejoin, k=DROP_K8, after_drop="global"),
            "paper_configuration": rows(paper, **DROP_PAPER),
            "paper_configuration_note": "the configuration the paper's claim corresponds to, stated in "
            "DROP_PAPER before it ran (issue 36): 8 workers, warm-started, every worker starting each "
            "round from the global parameters; the other sweeps are ablations",
            "warm_note": f"warm-started from part dp's {ctx.pretrain_steps}-step pretraining",
            "after_drop_note": "--after-drop own (diloco's default): the worker of a dropped outer_grad goes "
            "on from its own parameters; global: it goes back to the global ones",
            "claim": "dropping each outer_grad with probability 0.5 costs ~2% perplexity",
            "ppl_note": "vs_baseline_ppl_paired: per seed, exp(val_loss - the same seed's no-drop "
            "val_loss) - 1, the claim's measure (perplexity is exp(loss))",
        }

    order = [paper, warm, runs, rejoin, k8, k8_rejoin]
    return Plan(list({x.name: x for by_p in order for r in by_p.values() for x in r}.values())), report


def _schedule_average(ctx: Ctx, text: str) -> float:
    """Mean active workers over the rounds of a schedule (total worker-steps / steps)."""
    from diloco.core.membership import active_workers, parse_workers_schedule

    rounds = ctx.steps // ctx.H
    sched = parse_workers_schedule(text, 8)
    return sum(active_workers(sched, r, rounds) for r in range(rounds)) / rounds


def part_schedule(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    sched_runs = {}
    averages = {}
    for name, text in SCHEDULES.items():
        k_max = max(int(p.split(":")[1]) for p in text.split(","))
        sched_runs[name] = [
            ctx.diloco(s, k=k_max, extra=("--workers-schedule", text), note=f" schedule {text}")
            for s in ctx.seeds
        ]
        averages[name] = _schedule_average(ctx, text)
    constants = sorted({k for a in averages.values() for k in {math.floor(a), math.ceil(a)}})
    const_runs = {k: [ctx.diloco(s, k=k) for s in ctx.seeds] for k in constants}

    def baseline(avg: float) -> tuple[dict, str]:
        lo, hi = math.floor(avg), math.ceil(avg)
        if lo == hi:
            return entry(ctx, const_runs[lo], k=lo), f"constant k={lo}"
        a, b = entry(ctx, const_runs[lo]), entry(ctx, const_runs[hi])
        w = avg - lo
        per_seed = {
            s: round((1 - w) * a["per_seed"][s] + w * b["per_seed"][s], 5)
            for s in a["per_seed"]
            if s in b["per_seed"]
        }
        e = {
            "k": avg,
            "val_loss": _stats(list(per_seed.values())),
            "per_seed": per_seed,
            "runs": a["runs"] + b["runs"],
            "interpolated_from": {str(lo): a, str(hi): b},
        }
        return e, f"constant k={avg:g}: per seed, linear interpolation between constant k={lo} and k={hi}"

    def report() -> dict:
        rows = {}
        for name, runs in sched_runs.items():
            base, what = baseline(averages[name])
            e = versus(entry(ctx, runs, schedule=SCHEDULES[name], mean_active_workers=averages[name]), base)
            e["baseline"] = what
            e["baseline_val_loss"] = base["val_loss"]
            e["baseline_per_seed"] = base["per_seed"]
            rows[name] = e
        shapes = {}
        for a, b in (("4to8", "8to4"), ("1to8", "8to1")):
            shapes[f"{a}_vs_{b}"] = versus(
                {"per_seed": rows[a]["per_seed"], "val_loss": rows[a]["val_loss"]}, rows[b], "rel_diff"
            )
            shapes[f"{a}_vs_{b}"].pop("per_seed")
            shapes[f"{a}_vs_{b}"].pop("val_loss")
        return {
            "steps_per_active_worker": ctx.steps,
            "compared": "each schedule against constant workers with the same total worker-steps "
            "(the mean active workers over the rounds); worker_steps is the measured total",
            "by_schedule": rows,
            "constant": {str(k): entry(ctx, r, k=k) for k, r in const_runs.items()},
            "same_total_different_shape": shapes,
            "claim": "a schedule ends where its total compute says, not where its shape says",
        }

    runs = [x for r in sched_runs.values() for x in r] + [x for r in const_runs.values() for x in r]
    return Plan(runs), report


def part_codec(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    runs = {
        name: [ctx.diloco(s, extra=tuple(f), note=f" {name}" if f else "") for s in ctx.seeds]
        for name, f in CODECS.items()
    }

    def report() -> dict:
        base = entry(ctx, runs["fp32"])
        rows = {}
        for name, r in runs.items():
            e = versus(entry(ctx, r, codec=name), base)
            e["bytes_ratio_vs_fp32"] = ratio(base["bytes_sent_per_worker"], e["bytes_sent_per_worker"])
            rows[name] = e
        claim = "fp4 outer_grads: no loss regression; half of each outer_grad pruned: ~0.4% worse"
        return {"baseline": "fp32", "k": K, "by_codec": rows, "claim": claim}

    return Plan([x for r in runs.values() for x in r]), report


def part_H500(ctx: Ctx) -> tuple[Plan, Callable[[], dict]]:
    """The paper's headline interval: nano, warm, k = 4, H500_STEPS steps per worker (20 rounds
    at H = 500, 200 at H = 50); data parallel re-tuned at these steps around part dp's pick (k = 4,
    warm), DiLoCo at each H its inner lr, then its outer lr, around part dp's DiLoCo picks (k = 4,
    warm, at --H); all on the tuning seed and split."""
    steps, hs = ctx.h500_steps, ctx.h500_hs
    _, dp_choice, diloco_dp = dp_arms(ctx, K, True)
    dp = Around(
        dp_choice,
        lambda lr, w, s: ctx.dp(K, s, True, fair=True, lr=lr, warmup=w, steps=steps),
        lambda lr, w: ctx.dp(K, TUNE_SEED, True, fair=True, tuning=True, lr=lr, warmup=w, steps=steps),
        ctx.seeds,
    )

    def run(seed: int, tuning: bool, H: int, lr: float, ilr: float, w: int) -> Run:
        return ctx.diloco(
            seed, k=K, H=H, lr=lr, warm=True, fair=True, tuning=tuning, steps=steps, inner_lr=ilr, warmup=w
        )

    tuned = {
        H: Diloco(
            diloco_dp.get(ctx.H) or next(iter(diloco_dp.values())),
            functools.partial(lambda lr, ilr, w, s, H: run(s, False, H, lr, ilr, w), H=H),
            functools.partial(lambda lr, ilr, w, H: run(TUNE_SEED, True, H, lr, ilr, w), H=H),
            ctx.seeds,
        )
        for H in hs
    }

    def report() -> dict:
        base = entry(ctx, dp.runs(ctx), tuning=dp.report(ctx))
        dp_grid = dp.inner(ctx)
        dp_tuned = dp_grid.best_run(ctx) if dp_grid else None
        by_H = {}
        for H, arm in tuned.items():
            t = arm.inner(ctx)
            lr = t.best(ctx) if t else None
            e = entry(ctx, t.runs(ctx), outer_lr=lr, H=H, rounds=steps // H) if lr is not None else {}
            e = versus(e, base, "vs_dp") if lr is not None else {"val_loss": None, "vs_dp": None}
            if lr is not None:
                _with_match(ctx, base, e, steps)
            e["outer_lr_at_grid_edge"] = t.at_edge(ctx) if t else None
            e["lr_grid_tuning"] = t.table(ctx) if t else None
            # the rounds-vs-H explanation: where the curves peak and how the gap moves with rounds
            e["lr_grid_tuning_peak"] = t.peaks(ctx) if t else None
            g = arm.inner_grid(ctx)
            e["inner_lr_grid_tuning_peak"] = g.peaks(ctx) if g else None
            picks = dp_tuned, t.best_run(ctx) if t else None  # both arms' picks on the tuning split
            e["vs_dp_by_step_tuning"] = (
                gap_by_step(ctx, {"runs": [picks[0].name]}, {"runs": [picks[1].name]}) if all(picks) else None
            )
            e["tuning_run"] = picks[1].name if picks[1] else None  # the pick's run (the tuning figure)
            e["peak"] = peak(*_mean_curve(ctx, e.get("runs") or [])) if lr is not None else None
            e["vs_dp_by_step"] = gap_by_step(ctx, base, e) if lr is not None else None
            e["tuning"] = arm.report(ctx)
            picked = arm.picked(ctx)
            e["inner_lr"], e["warmup"] = picked if picked else (None, None)
            e["bytes_ratio_vs_dp"] = ratio(base.get("bytes_sent_per_worker"), e.get("bytes_sent_per_worker"))
            by_H[str(H)] = e
        lo, hi = (by_H.get(str(h), {}) for h in hs)

        def whole(e: dict) -> bool:  # every seed has run: a headline compares whole means only
            return bool(e.get("runs")) and not (e.get("missing") or e.get("failed"))

        gap = hi.get("vs_dp") if whole(hi) and whole(base) else None
        br = hi.get("bytes_ratio_vs_dp")
        # the two H at equal bytes (rounds): the picks' tuning runs, and the reported mean curves
        tuning_curves = [
            (h, *ctx.curve(e["tuning_run"])) if e.get("tuning_run") else (h, [], [])
            for h, e in zip(hs, (lo, hi), strict=True)
        ]
        mean_curves = (  # the reported seeds' mean curves, once every seed of both H has run
            [(h, *_mean_curve(ctx, e["runs"])) for h, e in zip(hs, (lo, hi), strict=True)]
            if whole(lo) and whole(hi)
            else None
        )
        base["tuning_run"] = dp_tuned.name if dp_tuned else None
        return {
            "k": K,
            "steps_per_worker": steps,
            "hs": list(hs),
            "dp": base,
            "by_H": by_H,
            f"h{hs[1]}_vs_dp_gap": gap,
            f"h{hs[1]}_bytes_ratio_vs_dp": br,
            f"h{hs[0]}_vs_dp_gap": lo.get("vs_dp") if whole(lo) and whole(base) else None,
            f"h{hs[1]}_dp_steps_to_match": hi.get("dp_steps_to_match"),
            f"h{hs[0]}_dp_steps_to_match": lo.get("dp_steps_to_match"),
            "per_round": per_round(*mean_curves) if mean_curves else None,
            "per_round_tuning": per_round(*tuning_curves),
            "target_within_2pct_at_400x_fewer_bytes": None
            if gap is None or br is None
            else bool(gap <= 0.02 and br >= 400),
            "claim": "DiLoCo at H = 500 ends below data parallel while communicating 500x less",
            "note": "data parallel re-tunes its inner lr at these steps over part dp's pick ×/÷2 (at "
            "its warm-up); DiLoCo at each H its inner lr over part dp's DiLoCo pick ×/÷2 (at part "
            "dp's DiLoCo outer lr and warm-up), then its outer lr over part dp's DiLoCo pick "
            f"×/÷{_num(GRID_STEP)} at that inner lr; every grid widening at an edge; all on the tuning "
            "seed and split; dp_steps_to_match = the share of data parallel's steps after which its "
            "evaluation curve (mean over seeds) reaches DiLoCo's final evaluation (when null, "
            "dp_steps_to_match_why says why); peak = the mean evaluation curve's highest point "
            "after the start (vs_start: relative to the start), lr_grid_tuning_peak and "
            "inner_lr_grid_tuning_peak the same for each tuning run; vs_dp_by_step = the mean "
            "curve against data parallel's at each evaluated step (H = 500: one per round), and "
            "vs_dp_by_step_tuning the same for both picks' tuning runs; tuning_run = the pick's tuning run "
            "(its curve is in docs/figures/reproduce_H500_tuning.png); per_round = the two H's mean curves "
            "at equal bytes: after the larger H's last round, each one's evaluation (val_loss_hi, "
            "val_loss_lo, lo_vs_hi) and the rounds the smaller H needs to reach the larger's final "
            "evaluation (lo_rounds_to_reach_hi, and its ratio to the larger's rounds); "
            "per_round_tuning the same for the picks' tuning runs; the headline gaps (h*_vs_dp_gap) are null "
            "until both arms have run every seed (by_H's vs_dp is of the seeds run so far, "
            "vs_dp_paired of the seeds both have)",
        }

    # its plan holds part dp's k = 4 grids (the picks it centres on): the part has run once a run
    # of its own steps has
    return Plan(
        tuned=[dp, *tuned.values()], owns=lambda r: r.init is not None and _work(r.flags)[1] == steps
    ), report


BUILDERS = {
    "dp": part_dp,
    "single": part_single,
    "workers": part_workers,
    "H": part_H,
    "outer": part_outer,
    "shards": part_shards,
    "drop": part_drop,
    "schedule": part_schedule,
    "codec": part_codec,
    "H500": part_H500,
}


# -- figures ------------------------------------------------------------------------------------
def _bars(
    ax,
    labels: list[str],
    rows: list[dict | None],
    colours: list[str] | None = None,
    hatches: list[str] | None = None,
) -> None:
    """Mean final val_loss with min–max error bars; the y axis zoomed to the values. A hatch
    ("//") marks a bar that is not a pick (an ablation)."""
    xs, ys, lo, hi, cs, hs, names = [], [], [], [], [], [], []
    for i, (label, e) in enumerate(zip(labels, rows, strict=True)):
        if not e or not e.get("val_loss"):
            continue
        v = e["val_loss"]
        xs.append(i)
        ys.append(v["mean"])
        lo.append(v["mean"] - v["min"])
        hi.append(v["max"] - v["mean"])
        cs.append(colours[i] if colours else f"C{i % 10}")
        hs.append(hatches[i] if hatches else "")
        names.append(label)
    if not xs:
        return
    bars = ax.bar(xs, ys, color=cs, yerr=[lo, hi], capsize=4)
    for bar, hatch in zip(bars, hs, strict=True):
        if hatch:
            bar.set_hatch(hatch)
            bar.set_alpha(0.55)
    ax.set_xticks(xs, names, rotation=20 if len(xs) <= 10 else 35, ha="right", fontsize=8)
    bottom, top = (
        min(y - d for y, d in zip(ys, lo, strict=True)),
        max(y + d for y, d in zip(ys, hi, strict=True)),
    )
    pad = max(0.02, 0.15 * (top - bottom))
    ax.set_ylim(bottom - 2 * pad, top + pad)
    ax.set_ylabel("final val_loss (mean, min–max over seeds)")
    ax.grid(axis="y", alpha=0.3)
    labelled = False
    for x, y, d in zip(xs, ys, hi, strict=True):  # the paired difference to the part's baseline
        paired = (rows[x] or {}).get("vs_baseline_paired")
        if paired and (paired["min"] or paired["max"]):
            labelled = True
            ax.annotate(
                f"{100 * paired['mean']:+.2f}%",
                (x, y + d),
                ha="center",
                xytext=(0, 3),
                textcoords="offset points",
                fontsize=8,
            )
    if labelled:
        ax.text(
            0.01,
            0.98,
            "labels: vs the baseline, mean of the per-seed differences",
            fontsize=8,
            transform=ax.transAxes,
            va="top",
        )


def _errline(ax, xs: list[float], rows: list[dict], label: str, **kw) -> None:
    pts = [(x, e["val_loss"]) for x, e in zip(xs, rows, strict=True) if e and e.get("val_loss")]
    if not pts:
        return
    x, v = zip(*pts, strict=True)
    y = [s["mean"] for s in v]
    err = [[s["mean"] - s["min"] for s in v], [s["max"] - s["mean"] for s in v]]
    ax.errorbar(x, y, yerr=err, marker="o", capsize=4, label=label, **kw)


def _dp_curve_start(ctx: Ctx, r: dict) -> str:
    """The start whose seed-0 curves part dp's figure plots for its headline k: warm, unless a
    run of it has no curve (its folder was lost before the ledger kept curves) and scratch's do."""
    row = r["per_k"][str(r["headline_k"])]
    starts = [s for s in ("warm", "scratch") if s in row]
    for start in starts:
        entries = [row[start][m] for m in ("single", "dp", "diloco")]
        if all(e.get("runs") and ctx.curve(e["runs"][0])[0] for e in entries):
            return start
    return starts[0]


def _curve_runs(ctx: Ctx, part: str, r: dict) -> list[str]:
    """The runs whose evaluation curves a part's figure plots (seed 0 of each compared method;
    part H500: every seed, as its figure plots their mean)."""
    if part == "H500":
        return [name for e in (r["dp"], *r["by_H"].values()) for name in e.get("runs") or []]
    if part == "dp":
        row = r["per_k"][str(r["headline_k"])][_dp_curve_start(ctx, r)]
        entries = [row[m] for m in ("single", "dp", "diloco")]
    elif part == "single":
        entries = [r["single"], r["diloco_k1"]]
    else:
        return []
    return [e["runs"][0] for e in entries if e.get("runs")]


def _h500_bands(ctx: Ctx, r: dict, runs: Callable[[dict], list[str]]) -> dict | None:
    """Part H500's curves to draw: for each H, then data parallel (key None), `_curve_band` of
    the runs `runs` names in its entry; None while an arm has no runs, no step they all
    evaluated, or an evaluation that is not a number."""
    bands = {H: _curve_band(ctx, runs(e)) for H, e in [*r["by_H"].items(), (None, r["dp"])]}
    return bands if all(band[0] for band in bands.values()) else None


def _h500_panels(by_round, by_step, bands: dict, ylabel: str, shade: bool) -> None:
    """Part H500's two panels: each H's curve against outer rounds (its steps ÷ H: the bytes;
    0, 1, 10, 100) and inner steps (the compute), data parallel's against steps, with its final
    evaluation as the rounds panel's line; `shade`: a band from each curve's lowest run to its
    highest. val_loss on a log scale, as H = 500's first rounds rise far above the rest."""
    import matplotlib.ticker

    for H, (xs, ys, lo, hi) in bands.items():
        label, colour = ("data parallel (k× batch)", "k") if H is None else (f"DiLoCo H={H}", None)
        colour = by_step.plot(xs, ys, marker=".", label=label, color=colour)[0].get_color()
        if shade:
            by_step.fill_between(xs, lo, hi, color=colour, alpha=0.2, lw=0)
        if H is None:
            by_round.axhline(ys[-1], color="k", ls=":", label="data parallel (its final evaluation)")
            continue
        rounds = [x / int(H) for x in xs]
        by_round.plot(rounds, ys, marker=".", label=label, color=colour)
        if shade:
            by_round.fill_between(rounds, lo, hi, color=colour, alpha=0.2, lw=0)
    by_round.set_xscale("symlog", linthresh=1)
    by_round.set_xlim(left=0)
    by_round.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 1, 10, 100
    by_round.set_xlabel("outer rounds (one model-sized exchange each)")
    by_step.set_xlabel("inner steps per worker (data parallel: its steps)")
    lo, hi = by_step.get_ylim()
    ticks = [y for y in (1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.7, 2, 2.5, 3, 4, 6, 10, 20, 40) if lo <= y <= hi]
    for ax in (by_round, by_step):
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(alpha=0.3, which="both")


def _h500_tuning_figure(ctx: Ctx, r: dict, where: Path, suffix: str = "") -> str | None:
    """Part H500's picks on the tuning seed and split (data parallel's and each H's tuning run at
    its picked lrs) against outer rounds and inner steps: where H = 500's rounds go, before the
    reported seeds have run. None (nothing drawn) until every arm has picked and its run has a
    curve of numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bands = _h500_bands(ctx, r, lambda e: [e["tuning_run"]] if e.get("tuning_run") else [])
    if bands is None:
        return None
    fig, (by_round, by_step) = plt.subplots(1, 2, figsize=(12, 4.6))
    _h500_panels(by_round, by_step, bands, "val_loss (the tuning split's fixed subset, log scale)", False)
    fig.suptitle(
        f"the tuning picks: k={r['k']}, warm, {r['steps_per_worker']} steps per worker, "
        f"tuning seed {TUNE_SEED}"
    )
    fig.tight_layout()
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"reproduce_H500_tuning{suffix}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def figures(ctx: Ctx, report: dict, where: Path, suffix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    drawn = []
    seeds = f"{len(ctx.seeds)} seeds"
    for part, r in report.items():
        if part not in PARTS or not isinstance(r, dict) or r.get("status") == "not run":
            continue
        if part == "H500" and (path := _h500_tuning_figure(ctx, r, where, suffix)):
            drawn.append(path)  # the tuning seed's picks: drawn once they are known, before the rest
        if r["wall_time"]["runs_missing"]:  # a part half run would overwrite its figure with less
            continue
        if any(not ctx.curve(name)[0] for name in _curve_runs(ctx, part, r)):
            _log(f"figure {part} not redrawn: a run it plots has no curve (neither a folder nor the ledger)")
            continue
        fig, axes = (
            plt.subplots(1, 2, figsize=(12, 4.6))
            if part in ("dp", "outer", "single", "H500")
            else (None, None)
        )
        if fig is None:
            fig, ax = plt.subplots(figsize=(7.5, 4.6))
        if part == "dp":
            # grouped by start: single once (it has no k), then each k's arms; an ablation one
            # inner-lr grid point below a pick stands hatched beside it
            labels, rows, cols, hatches = [], [], [], []
            colour = {"single": "C0", "dp": "C1", "diloco": "C2", "serial": "C3"}
            for start in ("scratch", "warm"):
                ks = [k for k in r["k"] if start in r["per_k"][str(k)]]
                for k in ks:
                    row = r["per_k"][str(k)][start]
                    for m in ("single", "dp", "diloco", "serial"):
                        if m not in row or (m == "single" and k != ks[0]):
                            continue
                        name = f"{m} {start}" if m == "single" else f"{m} k={k} {start}"
                        for entry, label, hatch in (
                            (row[m], name, ""),
                            (row.get(f"{m}_lr_below") or row[m].get("lr_below"), f"{name} lr÷2", "//"),
                        ):
                            if entry:
                                labels.append(label)
                                rows.append(entry)
                                cols.append(colour[m])
                                hatches.append(hatch)
            _bars(axes[0], labels, rows, cols, hatches)
            axes[0].set_title(
                f"final val_loss, {seeds} (C0 single, C1 dp, C2 DiLoCo, C3 serial k× steps;\n"
                "hatched: ablation one inner-lr grid point below the pick)",
                fontsize=10,
            )
            k = r["headline_k"]
            start = _dp_curve_start(ctx, r)
            row = r["per_k"][str(k)][start]
            for m in ("single", "dp", "diloco"):
                runs = row[m].get("runs") or []
                if runs:
                    xs, ys = ctx.curve(runs[0])
                    axes[1].plot(xs, ys, marker=".", label=m)
            axes[1].set_xlabel("inner steps per worker" + (" (after pretraining)" if start == "warm" else ""))
            axes[1].set_ylabel("val_loss (fixed subset)")
            axes[1].set_title(f"{start} start, k={k}, seed 0")
            axes[1].legend()
            axes[1].grid(alpha=0.3)
        elif part == "single":
            _bars(axes[0], ["AdamW (single)", "DiLoCo k=1"], [r["single"], r["diloco_k1"]])
            axes[0].set_title(f"one worker, equal steps, {seeds}")
            for m, lab in (("single", "AdamW (single)"), ("diloco_k1", "DiLoCo k=1")):
                runs = r[m].get("runs") or []
                if runs:
                    axes[1].plot(*ctx.curve(runs[0]), marker=".", label=lab)
            axes[1].set_xlabel("inner steps")
            axes[1].set_ylabel("val_loss (fixed subset)")
            axes[1].set_title("seed 0")
            axes[1].legend()
            axes[1].grid(alpha=0.3)
        elif part == "workers":
            ks = [int(k) for k in r["by_workers"]]
            _errline(ax, ks, list(r["by_workers"].values()), "DiLoCo")
            if mean(r["single"]) is not None:
                ax.axhline(mean(r["single"]), color="k", ls=":", label="single (AdamW)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.set_xlabel("workers k (equal steps per worker)")
            ax.set_ylabel("final val_loss")
            ax.set_title(f"number of workers, {seeds}")
            ax.legend()
            ax.grid(alpha=0.3)
        elif part == "H":
            rows = list(r["by_H"].values())
            xs = [e["bytes_sent_per_worker"] or float("nan") for e in rows]
            _errline(ax, xs, rows, f"DiLoCo k={r['k']}")
            for x, e in zip(xs, rows, strict=True):
                if e.get("val_loss") and math.isfinite(x):
                    ax.annotate(
                        f"H={e['H']}", (x, e["val_loss"]["mean"]), textcoords="offset points", xytext=(4, 6)
                    )
            dp = r["dp"]
            if dp.get("val_loss") and dp["bytes_sent_per_worker"]:
                _errline(ax, [dp["bytes_sent_per_worker"]], [dp], "data parallel", color="k")
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("bytes sent per worker")
            ax.set_ylabel("final val_loss")
            ax.set_title(f"communication interval H at equal compute, {seeds}")
            ax.legend()
            ax.grid(alpha=0.3)
        elif part == "outer":
            for name, e in r["by_optimizer"].items():
                grid = [(float(lr), v) for lr, v in e["lr_grid_seed0"].items() if v is not None]
                if grid:
                    axes[0].plot(*zip(*grid, strict=True), marker="o", label=name)
            axes[0].set_xscale("log")
            axes[0].set_xlabel("outer lr")
            axes[0].set_ylabel("final val_loss, seed 0")
            axes[0].set_title("outer lr grid (seed 0)")
            axes[0].legend()
            axes[0].grid(alpha=0.3)
            names = list(r["by_optimizer"])
            labels = [f"{n} lr={_num(r['by_optimizer'][n]['outer_lr'] or 0)}" for n in names]
            _bars(axes[1], labels, [r["by_optimizer"][n] for n in names])
            axes[1].set_title(f"best lr, {seeds}")
        elif part == "shards":
            _bars(ax, list(r["by_shards"]), list(r["by_shards"].values()))
            ax.set_title(f"shards, k={r['k']}, {seeds}")
        elif part == "drop":
            for key, label in (
                ("by_drop_prob", "from scratch"),
                ("by_drop_prob_warm", "warm start"),
                ("by_drop_prob_after_global", "from scratch, --after-drop global"),
                (f"by_drop_prob_k{DROP_K8}", f"from scratch, k={DROP_K8}"),
                (f"by_drop_prob_k{DROP_K8}_after_global", f"from scratch, k={DROP_K8}, --after-drop global"),
                ("paper_configuration", f"the paper's: warm, k={DROP_K8}, --after-drop global"),
            ):
                by = r.get(key) or {}  # the cost per seed against no drops, in percent
                paired = [e.get("vs_baseline_paired") for e in by.values()]
                pct = [
                    {"val_loss": {m: 100 * x[m] for m in ("mean", "min", "max")}} if x else None
                    for x in paired
                ]
                _errline(ax, [float(p) for p in by], pct, f"DiLoCo, {label}")
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xlabel("probability an outer_grad is dropped")
            ax.set_ylabel("final val_loss vs no drops, % (paired by seed)")
            ax.legend()
            ax.set_title(f"dropped outer_grads, k={r['k']} unless named, {seeds}")
            ax.grid(alpha=0.3)
        elif part == "schedule":
            labels, rows, cols = [], [], []
            for name, e in r["by_schedule"].items():
                labels += [name.replace("to", "→"), f"const {e['mean_active_workers']:g}"]
                rows += [e, {"val_loss": e["baseline_val_loss"]}]
                cols += ["C0", "C7"]
            _bars(ax, labels, rows, cols)
            ax.set_title(f"workers schedules vs constant of the same compute, {seeds}")
        elif part == "codec":
            names = list(r["by_codec"])
            _bars(ax, names, [r["by_codec"][n] for n in names])
            ax.set_title(f"outer_grad codecs, k={r['k']}, {seeds}")
        elif part == "H500":  # each arm's mean curve (the JSON's per_round, peak and vs_dp_by_step)
            bands = _h500_bands(ctx, r, lambda e: e.get("runs") or [])  # an arm with no pick: none
            if bands is None:
                _log(
                    "figure H500 not redrawn: an arm has no runs, no step all its runs evaluated, "
                    "or an evaluation that is not a number"
                )
                plt.close(fig)
                continue
            _h500_panels(*axes, bands, "val_loss (fixed subset, log scale)", True)
            fig.suptitle(
                f"k={r['k']}, warm, {r['steps_per_worker']} steps per worker: mean of {seeds} "
                "(band: lowest to highest seed)"
            )
        fig.tight_layout()
        where.mkdir(parents=True, exist_ok=True)
        path = where / f"reproduce_{part}{suffix}.png"  # suffix: another model's figures sit beside nano's
        fig.savefig(path, dpi=110)
        plt.close(fig)
        drawn.append(str(path))
    return drawn


# -- main ---------------------------------------------------------------------------------------
def _work(flags: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], int]:
    """A run's kind (method, workers) and its steps per worker, from its flags."""
    f = list(flags)

    def get(name: str, default: str) -> str:
        return f[f.index(name) + 1] if name in f else default

    kind = (get("--method", "diloco"), get("--workers", "1"))
    return kind, int(get("--inner-steps", "50")) * int(get("--rounds", "1"))


def _future(t, ctx: Ctx) -> list[Run] | None:
    """The runs a tuned arm still waiting for a grid will add at least (its grid, if not yet
    made, and its reported seeds), at placeholder settings that change no run's length; None
    where they cannot be told yet."""
    lr, w = INNER_LR_GRID[0], WARMUPS[0]
    if t.runs(ctx):
        return []
    if isinstance(t, Follow):  # runs at a Choice's pick: the serial reference, the ablations below
        return t.make(lr, w)
    if isinstance(t, IfStalled):  # only if a seed stalls, which no finished run tells yet
        return []
    if isinstance(t, Tuned):
        return [t.make(t.base[0], s) for s in t.seeds]
    if isinstance(t, Choice):  # one option's seeds, whichever is picked
        first = next(iter(t.options.values()))
        return [first.make(first.base[0], s) for s in first.seeds]
    if isinstance(t, Centred) and t.inner(ctx) is not None:
        return _future(t.inner(ctx), ctx)
    if isinstance(t, Diloco):  # its grids not yet made (the source's first), then its seeds
        first: list[Run] = []
        if (c := t._centres(ctx)) is not None:  # its inner grid is made: the part runs it now
            inner, at, w, outer = c
        elif isinstance(t.source, Diloco):  # part H500: part dp's DiLoCo grids (the tuning seed's runs)
            first = [r for r in _future(t.source, ctx) or [] if r.seed == TUNE_SEED]
            inner, at, outer = (lr, 2 * lr, 4 * lr), 1.0, (0.71, 1.0, 1.4)
        else:
            inner, at, outer = INNER_LR_GRID, _nearest(t.outer_base, PAPER_OUTER_LR), t.outer_base
        pick = inner[-1]  # a placeholder pick: the outer grid's run at `at` is the inner grid's
        first += [] if c is not None else [t.tune(at, x, w) for x in inner]
        return first + [t.tune(o, pick, w) for o in outer] + [t.make(at, pick, w, s) for s in t.seeds]
    if isinstance(t, Around):
        return [t.tune(x, w) for x in (lr, 2 * lr, 4 * lr)] + [t.make(lr, w, s) for s in t.seeds]
    return None


def pending(ctx: Ctx, plans: dict[str, Plan], counted: frozenset[str] = frozenset()) -> dict:
    """What is left of the parts as far as their finished runs tell (`--pending`): the runs they
    would start now, and those their tuned arms waiting for a grid will add at least (reported
    seeds, grids not yet made; not any widening), each with its run time estimated from the
    ledger's runs of the same method and workers (median seconds per step per worker, measured
    `--jobs` at a time); a run with a checkpoint counts only the rounds after it (`runs_resumed`
    of them). A run two parts share counts for the first; a run in `counted` (those of
    earlier invocations' `--pending`, `--pending-after`) for none. `runs` lists the runs counted."""
    per_step: dict[tuple[str, str], list[float]] = {}
    for row in ctx.ledger.rows.values():
        if row.get("elapsed_s") and row.get("flags") and "failed" not in row:
            kind, steps = _work(row["flags"])
            per_step.setdefault(kind, []).append(row["elapsed_s"] / steps)
    rate = {kind: statistics.median(v) for kind, v in per_step.items()}
    out: dict = {"parts": {}}
    seen: set[str] = set(counted)
    total = 0.0
    for part, plan in plans.items():
        left = [r for r in plan.all_runs(ctx) if not ctx.finished(r) and r.name not in seen]
        later, untold = [], 0
        for t in plan.tuned:
            runs = _future(t, ctx)
            untold += len(ctx.seeds) if runs is None else 0
            inits = [r.init for r in runs or [] if r.init is not None]  # pretraining: its model is needed
            later += [r for r in runs or [] if not ctx.finished(r) and r.name not in seen]
            later += [r for r in inits if not ctx.finished(r, model=True) and r.name not in seen]
        now = {r.name for r in left}
        later = list({r.name: r for r in later if r.name not in now}.values())
        seen |= {r.name for r in left + later}
        known = [(*_work(r.flags), ctx.done_share(r)) for r in left + later]
        seconds = sum(rate[k] * n * (1 - done) for k, n, done in known if k in rate)
        out["parts"][part] = {
            "runs_now": len(left),
            "runs_after_grids": len(later),
            "runs_not_told_yet": untold,
            "runs_without_estimate": sum(1 for k, _, _ in known if k not in rate),
            "runs_resumed": sum(1 for _, _, done in known if done > 0),
            "run_time_h": round(seconds / 3600, 1),
            "now": [r.label for r in left],
        }
        total += seconds
    out["run_time_h"] = round(total / 3600, 1)
    out["elapsed_h_at_jobs"] = round(total / 3600 / ctx.jobs, 1)
    out["runs"] = sorted(seen - counted)
    out["note"] = "a lower bound: widened grids and the runs not told yet come on top"
    return out


def _parts(values: list[str] | None) -> list[str]:
    if not values:
        return list(PARTS)
    out = []
    for v in values:
        for p in v.split(","):
            p = p.strip()
            if p and p not in PARTS:
                raise SystemExit(f"--part {p!r}: choose from {', '.join(PARTS)}")
            if p and p not in out:
                out.append(p)
    return out


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    """Positive finite numbers, a comma list (learning rates)."""
    values = tuple(float(x) for x in text.split(","))
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give learning rates above 0, e.g. 0.3,0.5,0.7,1")
    return values


def _words(text: str) -> tuple[str, ...]:
    words = tuple(w.strip() for w in text.split(","))
    if not words or set(words) - {"scratch", "warm"}:
        raise argparse.ArgumentTypeError(f"choose scratch, warm or both, got {text!r}")
    return words


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with its defaults settled (H, the H values, workdir, ledger, JSON, figures)
    and checked (exit code 2 on a bad one): what `Ctx` and main read. Also used by the benchmarks
    that rerun part H500's runs (h500_outer_step.py), so their runs are named as the lane's."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--part", action="append", help=f"{'|'.join(PARTS)}; repeatable or a comma list (default all)"
    )
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny model and few steps: checks the plumbing")
    ap.add_argument("--jobs", type=int, default=2, help="diloco train subprocesses at once (one core each)")
    ap.add_argument("--steps", type=int, default=1000, help="inner steps per worker S")
    ap.add_argument("--pretrain-steps", type=int, default=1000, help="steps of the warm start's pretraining")
    ap.add_argument("--model", default="nano", choices=MODELS)
    ap.add_argument("--ks", type=_ints, default=DP_KS, help="part dp: workers k, a comma list (default 4,8)")
    ap.add_argument(
        "--serial-ks",
        type=_ints,
        help="part dp: the k whose serial reference (1 worker, k × the steps) runs (default every --ks)",
    )
    ap.add_argument(
        "--starts", type=_words, default=("scratch", "warm"), help="part dp: scratch, warm or both (default)"
    )
    ap.add_argument(
        "--lr-grid",
        type=_floats,
        default=OUTER_LR_GRID,
        help="part dp: DiLoCo's outer lr grid, a comma list (default 0.3,0.5,0.7,1)",
    )
    ap.add_argument(
        "--dp-hs",
        type=_ints,
        help="part dp: DiLoCo's H values, each with its own outer-lr grid (default 50; e.g. 10,50 "
        "for k = 8 with more rounds)",
    )
    ap.add_argument(
        "--hs",
        type=_ints,
        help="part H: the H values, a comma list (default 10,25,50,100,250; the baseline H = 50 always runs)",
    )
    ap.add_argument(
        "--h-k",
        type=int,
        default=K,
        help=f"part H: workers k (default {K}); another k needs --part H alone and writes its own JSON "
        "and figure (reproduce_diloco_H_k<k>.json, reproduce_H_k<k>.png)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        help="run folders (default benchmarks/results/reproduce_runs/; --quick: reproduce_quick_runs/)",
    )
    ap.add_argument(
        "--ledger",
        type=Path,
        help="the ledger's folder (default benchmarks/results/reproduce_ledger/; --quick: the workdir's "
        "_ledger/); give main's when running from another worktree",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="the JSON (default benchmarks/results/reproduce_diloco.json; _micro, _quick, _H_k<K> for "
        "--model micro, --quick, --h-k); another name than the default's reports and draws only the "
        "parts --part names, its figures named with what it adds to the default's name",
    )
    ap.add_argument(
        "--report-only", action="store_true", help="no new runs: the JSON and figures from what exists"
    )
    ap.add_argument("--plot-only", action="store_true", help="no new runs: the figures only")
    ap.add_argument(
        "--pending",
        action="store_true",
        help="no new runs: print (JSON) the runs the parts would start now and their estimated run time",
    )
    ap.add_argument(
        "--pending-after",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="with --pending: the output of earlier invocations' --pending, whose runs this one does not "
        "count again (a lane of several invocations that share runs)",
    )
    args = ap.parse_args(argv)
    args.parts = parts = _parts(args.part)
    args.H, hs = 50, args.hs or HS
    suffix = "" if args.model == "nano" else f"_{args.model}"
    if args.quick:
        args.steps, args.H, hs = QUICK_STEPS, QUICK_H, args.hs or QUICK_HS
        args.pretrain_steps = QUICK_STEPS
        suffix = "_quick"
    args.hs = tuple(sorted({*hs, args.H}))  # the baseline H always runs
    args.workdir = args.workdir or RESULTS / f"reproduce{suffix}_runs"  # *_runs/ is git-ignored
    args.h_suffix = h_suffix = "" if args.h_k == K else f"_k{args.h_k}"  # part H at another k: its own files
    default_out = RESULTS / f"reproduce_diloco{suffix}{'_H' if h_suffix else ''}{h_suffix}.json"
    args.out = args.out or default_out
    stem, base = args.out.stem, default_out.stem  # another name's figures carry what it adds
    args.out_suffix = stem.removeprefix(base) if stem == base or stem.startswith(f"{base}_") else f"_{stem}"
    others = [f"reproduce_diloco_{m}" for m in (*MODELS, "quick") if f"_{m}" != suffix and m != "nano"]
    for other in others:  # its figures would take that model's names
        if stem != base and (stem == other or stem.startswith(f"{other}_")):
            ap.error(f"--out {args.out}: {other}.json is another model's; give that --model or rename it")
    args.ledger_dir = ledger_dir = args.ledger or (
        args.workdir / "_ledger" if args.quick else RESULTS / f"reproduce{suffix}_ledger"
    )
    args.ledger = ledger_dir / "runs.jsonl"  # Ctx reads the file
    args.figures = args.workdir / "figures" if args.quick else FIGURES
    args.fig_suffix = (
        ("" if args.model == "nano" or args.quick else f"_{args.model}") + h_suffix + args.out_suffix
    )
    args.dp_hs = tuple(args.dp_hs or (args.H,))
    bad = [h for h in {*args.hs, *args.dp_hs} if h < 1 or args.steps % h] + (  # args.hs holds args.H
        [args.H] if args.pretrain_steps % args.H else []
    )
    if args.h_k < 1:
        ap.error("--h-k must be ≥ 1")  # exit code 2
    if args.h_k != K and parts != ["H"]:
        ap.error(f"--h-k {args.h_k} runs part H at another k: give --part H alone")
    if bad or args.seeds < 1 or args.jobs < 1:
        ap.error(  # exit code 2
            f"--steps and --pretrain-steps must be multiples of every H {args.hs} (each ≥ 1); "
            "--seeds, --jobs ≥ 1"
        )
    args.counted = counted = set()
    for path in args.pending_after or []:
        try:
            counted |= set(json.loads(path.read_text())["runs"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(  # exit code 2, before anything is written
                f"--pending-after {path}: not the output of --pending ({type(e).__name__}: {e}); "
                "give the JSON an earlier `--pending` printed"
            )
    return args


def main() -> None:
    args = parse_args()
    parts, h_suffix, ledger_dir = args.parts, args.h_suffix, args.ledger_dir
    ctx = Ctx(args)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.quick:
        ctx.config_path.write_text(QUICK_CONFIG)
    timing_path = ledger_dir / "part_timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    before = {p: dict(v) for p, v in timing.items()}  # earlier invocations' totals
    built = {p: BUILDERS[p](ctx) for p in PARTS}
    if args.pending:
        print(json.dumps(pending(ctx, {p: built[p][0] for p in parts}, frozenset(args.counted)), indent=1))
        return
    t0 = time.perf_counter()

    def record(part: str, span: float, n: int) -> None:
        """A part's totals over every invocation, rewritten after each run it finishes."""
        old = before.get(part + h_suffix, {})
        timing[part + h_suffix] = {
            **old,
            "elapsed_s": round(old.get("elapsed_s", 0) + span, 1),
            "new_runs": old.get("new_runs", 0) + n,
            "jobs": args.jobs,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        timing_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = timing_path.with_suffix(".tmp")  # whole or not at all: a lane is killed mid-run
        tmp.write_text(json.dumps(timing, indent=2) + "\n")
        os.replace(tmp, timing_path)

    if not (args.report_only or args.plot_only):
        _log(f"parts {', '.join(parts)}; {args.seeds} seeds; {args.jobs} jobs; runs in {args.workdir}")
        scheduler = Scheduler(ctx, record)
        n = scheduler.execute({p: built[p][0] for p in parts})
        _log(f"{n} new runs in {time.perf_counter() - t0:.0f} s")
        if scheduler.stopped:
            raise SystemExit("a run was stopped by a signal; the finished runs are in the ledger: run again")
    result: dict = {
        "benchmark": "reproduce_diloco",
        "quick": args.quick,
        "model": "tiny (quick.toml)" if args.quick else args.model,
        "steps_per_worker": args.steps,
        "inner_steps_H": args.H,  # of every part but H's sweep (the key "H" is that part)
        "seeds": args.seeds,
        "pretrain_steps": args.pretrain_steps,
        "pretrain_seed": f"{PRETRAIN_SEED} + seed",
        "workdir": str(args.workdir.relative_to(ROOT) if args.workdir.is_relative_to(ROOT) else args.workdir),
        "parts_run_now": [] if (args.report_only or args.plot_only) else parts,
    }
    for plan, _ in built.values():  # runs finished before the ledger, or by an older copy of this file
        for r in plan.all_runs(ctx):
            ctx.keep(r)
    ctx.ledger.save()
    # the others are the default JSON's (an --out of another name: the parts it names only)
    reported = PARTS if args.h_k == K and not args.out_suffix else parts
    for p in reported:
        plan, report = built[p]
        runs = [r for r in plan.all_runs(ctx) if plan.owns is None or plan.owns(r)]
        have = [r for r in runs if ctx.result(r) is not None]
        if not have:
            result[p] = {"status": "not run", "runs_planned": len(runs)}
            continue
        part = report()
        res = [ctx.result(r) for r in have]
        t = timing.get(p + h_suffix, {})
        part["wall_time"] = {
            "runs": len(runs),
            "runs_finished": sum(1 for x in res if not x.get("failed")),
            "runs_failed": sum(1 for x in res if x.get("failed")),
            "runs_missing": len(runs) - len(have),
            "runs_wall_s_sum": round(sum((x.get("elapsed_s") or x.get("wall_time_s") or 0) for x in res), 1),
            "runs_wall_s_unknown": sum(1 for x in res if not (x.get("elapsed_s") or x.get("wall_time_s"))),
            "runs_wall_s_before_ledger": t.get("runs_wall_s_before_ledger"),
            "worker_steps_sum": sum(x.get("inner_steps", 0) for x in res if not x.get("failed")),
            # an entry that has counted no run yet (a part re-run from now on): no time to give
            "elapsed_s": t.get("elapsed_s") if t.get("new_runs", 1) or t.get("elapsed_s") else None,
            "elapsed_note": "summed over the invocations that ran new runs of this part, each from "
            "its first start to its last finish, or its last minute with a run in flight if later "
            "(an invocation started before 2026-12-07 22:00 only to its last finish: one stopped at "
            "a session's end left out its runs' time since then, which their own times count as they "
            "resume); parts overlap: a slot one part leaves idle runs the next's runs; runs shared "
            "with parts run before it are not counted again",
            "jobs": t.get("jobs"),
        }
        result[p] = part
    drawn = figures(ctx, {p: result[p] for p in reported}, args.figures, args.fig_suffix)
    result["figures"] = [str(Path(d).relative_to(ROOT)) if Path(d).is_relative_to(ROOT) else d for d in drawn]
    if args.plot_only:
        _log(f"figures: {', '.join(drawn)}")
        return
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    # the headline of its own (issue 36), from the invocation that asked for the part
    if "H500" in parts and result["H500"].get("status") != "not run":
        own = args.out.with_name(args.out.stem + "_H500.json")
        part = {"benchmark": "reproduce_diloco part H500", **result["H500"]}
        own.write_text(json.dumps(part, indent=2) + "\n")
    _log(f"saved {args.out}; figures {len(drawn)}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
