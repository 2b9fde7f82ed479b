"""Bytes to quality (issue 35): how few bytes DiLoCo and SparseLoCo need to reach data parallel's
final validation loss, each method's outer lr tuned per H, from the reproduction's warm start.

The runs are reproduce_diloco.py's (its `Ctx`, `Tuned` grids, `Scheduler` and ledger,
benchmarks/results/reproduce_ledger/): nano, k = 4 workers, S = 1,000 inner steps per worker,
each run warm-started from the pretrained model of part dp (1,000 single-worker steps, seed
1000 + seed). The target is part dp's warm data parallel (k = 4, S steps of a 4× batch): its
final loss, seed by seed (on the fixed eval subset the runs' curves score). It is data parallel
as part dp ran it before issue 36's tuning rules (inner lr 1e-3, 30 warm-up steps), and DiLoCo's
outer lr is tuned on seed 0 as part dp did then. A run already in the ledger (part dp's fp32
H = 50 grid, for one) is not run again.

Methods (`--methods`), each at H ∈ {10, 50, 100, 250, 500} (`--hs`) unless said:

- `fp32`: DiLoCo, Nesterov outer optimizer, outer_grads in fp32.
- `fp4_ef`: the same, fp4 with error feedback.
- `topk10_ef`: chunked top-k (10% of each 4,096-value chunk, fp32 values) with error feedback.
- `topk3_2bit_ef` (H = 50 only): chunked top-k 3%, 2-bit values, error feedback, Nesterov: the
  bytes of `sparseloco3` with DiLoCo's global momentum, to tell what the decayed accumulator adds.
- `sparseloco1`, `sparseloco3`, `sparseloco10`: `--outer-opt sparseloco` (chunked top-k of the
  accumulator e ← 0.95 e + Δ, 2-bit values, no global momentum) at 1%, 3%, 10% density.

Tuning, on seed 0 (`TunedPair`): each method has two settings, its outer lr and a second one,
Nesterov's momentum (default 0.9, grid {0.8, 0.9, 0.95}) or SparseLoCo's decay β (default 0.95,
the paper's; grid {0.8, 0.9, 0.95}). At the targets' H (50): the lr grid at the default second
value (Nesterov arms {0.7, 1.0}, SparseLoCo {2, 4}; a grid grows past an edge its best sits on
by ×1.4 or ÷1.4, at most four times), then the second setting's grid at that lr (growing past an
edge with 1 − v doubled or halved, at most twice), then, if its pick is not the default, the lr
again around the first pick at it. Every other H tunes its lr at the targets' H's second pick,
on a grid around the targets' H's lr pick (it and its neighbours in the grid it was picked
from; widening the same way). The pick runs on 2 seeds (3 at H = 50). Where the default wins,
the runs are the same runs as without the second setting (it is not passed), so earlier ledger
rows count.

Bytes are uploads per worker, the real size of each message (summary.json's
`bytes_sent_per_worker`; a round's bytes are the same every round). A run reaches the target at
its first evaluation (a multiple of H; every 5 rounds at H = 10, so there the bytes may be over
by up to 4 rounds) at or below data parallel's final loss on the same fixed eval subset, same
seed; its bytes then are (rounds done) × (bytes per round). A point (method, H) reaches the target when
every seed does, and its `bytes_ratio` is the largest per-seed ratio to data parallel's bytes.

JSON (benchmarks/results/bytes_to_loss.json): `dp_final_val_loss`, `dp_bytes_sent_per_worker`,
`points` (per method and H: the lr grid on seed 0, the pick, the final val_loss over seeds, vs
fp32 at that H paired, bytes, bytes to target and ratio), `frontier` (the points no other point
beats on both final loss and bytes), `best_bytes_ratio` and `best_run`, and the issue's fields:
`sparseloco_vs_fp32_pct_H50` (SparseLoCo 3%, 2-bit, H = 50, mean paired % vs fp32, 3 seeds),
`sparseloco1_vs_fp32_pct_H50`, `chunked_topk10_ef_vs_fp32_pct` (H = 50), and from
reproduce_diloco.py's part codec (from scratch, lr 0.7, 3 seeds) `pruning_half_vs_fp32_pct` and
`pruning_half_ef_vs_fp32_pct`. Figure: docs/figures/bytes_to_loss.png, final loss against
bytes sent on log axes, one curve per method (its points over H). Earlier results (issue 11's
untuned, from-scratch version) are in bytes_to_loss_2026-11.json.

    python benchmarks/bytes_to_loss.py                       # every point: ~130 runs, 2 at a time
    python benchmarks/bytes_to_loss.py --hs 50               # the targets' H first
    python benchmarks/bytes_to_loss.py --report-only         # the JSON and figure from the ledger
    python benchmarks/bytes_to_loss.py --quick --hs 10 --methods fp32,sparseloco3  # plumbing
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import reproduce_diloco as rd

ROOT = rd.ROOT
FIGURE = rd.FIGURES / "bytes_to_loss.png"
K = 4
HS = (10, 50, 100, 250, 500)
NESTEROV_GRID, SPARSELOCO_GRID = (0.7, 1.0), (2.0, 4.0)
CHUNK = ("--topk-chunk", "4096")
# name -> (outer optimizer, flags, the targets' H's first lr grid, whether it runs at every H or
# the targets' H only)
METHODS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...], bool]] = {
    "fp32": ("nesterov", (), NESTEROV_GRID, True),
    "fp4_ef": ("nesterov", ("--codec", "fp4", "--error-feedback"), NESTEROV_GRID, True),
    "topk10_ef": (
        "nesterov",
        ("--codec", "topk", "--topk-fraction", "0.1", *CHUNK, "--error-feedback"),
        NESTEROV_GRID,
        True,
    ),
    "topk3_2bit_ef": (
        "nesterov",
        ("--codec", "topk", "--topk-fraction", "0.03", *CHUNK, "--topk-bits", "2", "--error-feedback"),
        NESTEROV_GRID,
        False,
    ),
    "sparseloco1": ("sparseloco", ("--topk-fraction", "0.01"), SPARSELOCO_GRID, True),
    "sparseloco3": ("sparseloco", ("--topk-fraction", "0.03"), SPARSELOCO_GRID, True),
    "sparseloco10": ("sparseloco", ("--topk-fraction", "0.1"), SPARSELOCO_GRID, True),
}


def _log(text: str) -> None:
    print(f"[bytes_to_loss] {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def context(args: argparse.Namespace) -> rd.Ctx:
    """reproduce_diloco's settings for this benchmark: part dp's warm start, steps and ledger."""
    ns = argparse.Namespace(
        quick=args.quick,
        ks=(K,),
        starts=("warm",),
        lr_grid=rd.OUTER_LR_GRID,
        serial_ks=(),
        model="nano",
        steps=rd.QUICK_STEPS if args.quick else 1000,
        H=rd.QUICK_H if args.quick else 50,
        hs=args.hs,
        h_k=K,
        seeds=3,
        pretrain_steps=rd.QUICK_STEPS if args.quick else 1000,
        jobs=args.jobs,
        workdir=args.workdir,
        ledger=args.ledger / "runs.jsonl",
    )
    return rd.Ctx(ns)


# outer optimizer -> its second setting (TunedPair): ctx.diloco's keyword or a flag, the default
# (not passed, so a run at it is the run without it), and the base grid
SECOND = {
    "nesterov": ("momentum", 0.9, (0.8, 0.9, 0.95)),
    "sparseloco": ("--ef-decay", 0.95, (0.8, 0.9, 0.95)),
}


# how many times an lr grid may grow past an edge (×1.4 or ÷1.4 each): twice (reproduce_diloco's
# GRID_WIDEN) left SparseLoCo's best at H = 10 on the edge, and a grid whose best sits on its edge
# tunes nothing
LR_WIDEN = 4


def _around(lr: float, grid: tuple[float, ...] = ()) -> tuple[float, ...]:
    """An lr grid centred on `lr`: its neighbours in `grid` (the grid it was picked from, so the
    values are ones already run), else lr ÷ 1.4 and lr × 1.4."""
    i = grid.index(lr) if lr in grid else -1
    lo = grid[i - 1] if i > 0 else float(f"{lr / rd.GRID_STEP:.2g}")
    hi = grid[i + 1] if 0 <= i < len(grid) - 1 else float(f"{lr * rd.GRID_STEP:.2g}")
    return (lo, lr, hi)


def _widen(v: float, lower: bool) -> float | None:
    """The next value past an edge of a second setting's grid: 1 − v doubled (lower) or halved."""
    w = float(f"{1 - (1 - v) * (2 if lower else 0.5):.4g}")
    return w if 0 <= w < 1 else None


@dataclass
class TunedPair:
    """A method's outer lr and its second setting (Nesterov's momentum, SparseLoCo's decay β),
    tuned on seed 0 one after the other at the targets' H, the second then held at every H:

    1. the outer-lr grid at the default second value (rd.Tuned: it widens past an edge);
    2. at that lr, the second setting's grid (widening past an edge, 1 − v ×2 or ÷2, at most
       twice);
    3. if the pick is not the default, the lr again at it: lr ÷ 1.4, lr, lr × 1.4 (widening).

    At another H (`target` set: the targets' H's pair) the lr grid runs at the targets' H's
    second pick, around its lr pick (`_around`, widening). The pick runs on every seed.
    Scheduled like a `rd.Tuned`."""

    opt: str
    make: Callable[[float, float | None, int], rd.Run]  # (lr, second or None: default, seed)
    base: tuple[float, ...]
    seeds: list[int]
    target: TunedPair | None = None

    def _v(self, v: float) -> float | None:
        return None if v == SECOND[self.opt][1] else v

    def _first(self) -> rd.Tuned:
        return rd.Tuned(lambda lr, s: self.make(lr, None, s), self.base, self.seeds, widen=LR_WIDEN)

    def _at(self, lr: float) -> rd.Tuned:
        """The second setting's values at `lr` as an rd.Tuned over them (its runs and its pick;
        its ×1.4 widening is not used: `second_grid` widens in 1 − v)."""
        return rd.Tuned(lambda v, s: self.make(lr, self._v(v), s), (), self.seeds)

    def _second_runs(self, lr: float, grid: tuple[float, ...]) -> list[rd.Run]:
        return [self._at(lr)._grid_run(v) for v in grid]

    def _second_best(self, ctx: rd.Ctx, lr: float, grid: tuple[float, ...]) -> float | None:
        return self._at(lr)._best(ctx, grid)

    def _choice(self, ctx: rd.Ctx) -> tuple[float | None, tuple[float, ...], float | None]:
        """Steps 1 and 2 as far as their runs have finished, read once (runs finish while the
        scheduler asks): the default's lr pick, the second setting's grid at it (widened past
        an edge; empty until that lr is known) and its pick (None until that grid has run)."""
        if self.target is not None:
            return self.target._choice(ctx)
        lr = self._first().best(ctx)
        if lr is None:
            return None, (), None
        grid = sorted(SECOND[self.opt][2])
        v = self._second_best(ctx, lr, tuple(grid))
        for _ in range(rd.GRID_WIDEN):
            w = None  # the value past the edge the best sits on (none: inside, or unfinished)
            if v is not None and v in (grid[0], grid[-1]):
                w = _widen(v, lower=v == grid[0])
            if w is None:
                break
            grid = sorted({*grid, w})
            v = self._second_best(ctx, lr, tuple(grid))
        return lr, tuple(grid), v

    def second_grid(self, ctx: rd.Ctx) -> tuple[float, ...]:
        """The second setting's grid at the default's lr (`_choice`)."""
        return self._choice(ctx)[1]

    def second(self, ctx: rd.Ctx) -> float | None:
        """The second setting's pick, once its grid has finished."""
        return self._choice(ctx)[2]

    def tuned(self, ctx: rd.Ctx) -> rd.Tuned | None:
        """The lr grid at the second setting's pick (None until it is known): at another H,
        around the targets' H's lr pick (None until that is known too)."""
        first_lr, _, v = self._choice(ctx)
        if v is None:
            return None
        v = self._v(v)
        make = functools.partial(lambda lr, s, v: self.make(lr, v, s), v=v)
        if self.target is None:  # the default: step 1's grid; else step 3 around step 1's pick
            return (
                self._first() if v is None else rd.Tuned(make, _around(first_lr), self.seeds, widen=LR_WIDEN)
            )
        picked = self.target.tuned(ctx)
        lr = picked.best(ctx) if picked is not None else None
        if lr is None:
            return None
        return rd.Tuned(make, _around(lr, picked.grid(ctx)), self.seeds, widen=LR_WIDEN)

    def choice_runs(self, ctx: rd.Ctx) -> list[rd.Run]:
        """Steps 1 and 2's runs; for a pair at another H, every tuning run of the targets' H's."""
        if self.target is not None:
            return self.target.grid_runs(ctx)
        lr, grid, _ = self._choice(ctx)
        return self._first().grid_runs(ctx) + (self._second_runs(lr, grid) if grid else [])

    def grid_runs(self, ctx: rd.Ctx) -> list[rd.Run]:
        t = self.tuned(ctx)
        return self.choice_runs(ctx) + (t.grid_runs(ctx) if t else [])

    def runs(self, ctx: rd.Ctx) -> list[rd.Run]:
        t = self.tuned(ctx)
        return t.runs(ctx) if t else []

    def best(self, ctx: rd.Ctx) -> float | None:
        t = self.tuned(ctx)
        return t.best(ctx) if t else None

    def table(self, ctx: rd.Ctx) -> dict[str, float | None]:
        """The lr grid at the pick; until the pick is known, the first lr grid's (if any)."""
        t = self.tuned(ctx) or (self._first() if self.target is None else None)
        return t.table(ctx) if t else {}

    def report(self, ctx: rd.Ctx) -> dict:
        """The second setting's tuning: its grid on seed 0 (at the default's lr) and pick."""
        key, default, _ = SECOND[self.opt]
        out = {"setting": key.lstrip("-"), "default": default}
        lr, grid, pick = self._choice(ctx)  # read once
        runs = (self.target or self)._second_runs(lr, grid) if grid else []
        table = {rd._num(v): rd._loss(ctx.result(r)) for v, r in zip(grid, runs, strict=True)}
        out.update(grid=list(grid), grid_seed0=table, pick=pick)
        if self.target is None:
            out["lr_grid_seed0_at_default"] = self._first().table(ctx)
        return out

    def at_edge(self, ctx: rd.Ctx) -> bool | None:
        t = self.tuned(ctx)
        return t.at_edge(ctx) if t else None


def plan(ctx: rd.Ctx, methods: list[str], hs: tuple[int, ...]) -> dict[tuple[str, int], TunedPair]:
    """One tuned pair per (method, H), the targets' H first (the scheduler keeps this order); the
    targets' H's pair of each method exists (other H wait for its second setting) even where
    --hs leaves it out."""
    target_h = ctx.H
    out: dict[tuple[str, int], TunedPair] = {}
    for name in methods:
        opt, flags, grid, everywhere = METHODS[name]
        key, _, _ = SECOND[opt]
        note = "" if name == "fp32" else f" {name}"

        def make(
            lr: float, v: float | None, s: int, H: int, opt=opt, flags=flags, note=note, key=key
        ) -> rd.Run:
            extra, more, tail = flags, {}, note
            if v is not None and key.startswith("--"):
                extra, tail = (*flags, key, rd._num(v)), f"{note} β={rd._num(v)}"
            elif v is not None:
                more = {key: v}
            return ctx.diloco(s, k=K, H=H, lr=lr, opt=opt, warm=True, extra=extra, note=tail, **more)

        at_target = TunedPair(opt, functools.partial(make, H=target_h), grid, ctx.seeds)
        for H in sorted(hs, key=lambda h: (h != target_h, h)):
            if H == target_h:
                out[name, H] = at_target
            elif everywhere:
                out[name, H] = TunedPair(opt, functools.partial(make, H=H), grid, ctx.seeds[:2], at_target)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1] != target_h, kv[0][1])))


def parts(dp_runs: list[rd.Run], tuned: dict[tuple[str, int], TunedPair]) -> dict[str, rd.Plan]:
    """The scheduler's parts: data parallel's runs, then a part per H in `tuned`'s order (the
    targets' H first). It fills slots part by part, so the targets' H's tuning, which every other
    H waits for, and its seeds run before the rest (one part: later grids queued behind all)."""
    out = {"dp": rd.Plan(runs=dp_runs)}
    for (_, H), t in tuned.items():
        out.setdefault(f"H={H}", rd.Plan()).tuned.append(t)
    return out


def to_target(steps: list[int], losses: list[float], target: float) -> int | None:
    """The first evaluated step whose loss is at or below `target` (None: never)."""
    return next((s for s, v in zip(steps, losses, strict=True) if v <= target), None)


def targets(ctx: rd.Ctx) -> dict[str, float]:
    """Data parallel's final loss on the fixed eval subset, by seed: what the runs' curves (the
    same subset) are read against (the reported val_loss scores the whole validation split)."""
    out = {}
    for s in ctx.seeds:
        res = ctx.result(ctx.dp(K, s, warm=True)) or {}
        if isinstance(res.get("final_subset_val_loss"), (int, float)):
            out[str(s)] = res["final_subset_val_loss"]
    return out


def point(ctx: rd.Ctx, name: str, H: int, t: TunedPair, dp: dict) -> dict:
    """One (method, H): the grids, the picks, the seeds' losses and the bytes to the target."""
    lr = t.best(ctx)
    row: dict = {"method": name, "H": H, "lr_grid_seed0": t.table(ctx), "outer_lr": lr}
    row["second"] = t.report(ctx)
    row["outer_lr_at_grid_edge"] = t.at_edge(ctx)
    if lr is None:
        return {**row, "val_loss": None, "reached": None}
    runs = t.runs(ctx)
    row.update(rd.entry(ctx, runs))
    per_seed_ratio: dict[str, float | None] = {}
    no_curve, failed = [], False
    for r in runs:
        res = ctx.result(r)
        target = dp["subset_target_by_seed"].get(str(r.seed))
        failed |= bool(res and res.get("failed"))
        if rd._loss(res) is None or target is None or not dp.get("bytes_sent_per_worker"):
            continue
        steps, losses = ctx.curve(r.name)
        if not steps:  # a row rebuilt by hand before the ledger kept curves
            no_curve.append(r.name)
            continue
        per_round = res["bytes_sent_per_worker"] / (ctx.steps // H)
        step = to_target(steps, losses, target)
        per_seed_ratio[str(r.seed)] = (
            None if step is None else round(per_round * (step // H) / dp["bytes_sent_per_worker"], 8)
        )
    if no_curve:
        row["no_curve"] = no_curve
    done = len(per_seed_ratio) == len(runs)
    row["bytes_ratio_by_seed"] = per_seed_ratio
    row["reached"] = (
        False if failed else (all(v is not None for v in per_seed_ratio.values()) if done else None)
    )
    row["bytes_ratio"] = max(per_seed_ratio.values()) if row["reached"] else None
    return row


def frontier(points: list[dict]) -> list[str]:
    """The points no other point beats on both mean final loss and bytes sent (by bytes)."""
    have = sorted(
        (p for p in points if p.get("val_loss") and p.get("bytes_sent_per_worker")),
        key=lambda p: (p["bytes_sent_per_worker"], p["val_loss"]["mean"]),
    )
    out, best = [], float("inf")
    for p in have:
        if p["val_loss"]["mean"] < best:
            best = p["val_loss"]["mean"]
            out.append(f"{p['method']} H={p['H']}")
    return out


def pct(e: dict | None, key: str = "vs_fp32_paired") -> float | None:
    """The mean paired difference in percent (None until every seed ran)."""
    s = (e or {}).get(key)
    return None if not s or s["n"] < 2 else round(100 * s["mean"], 3)


def report(ctx: rd.Ctx, tuned: dict[tuple[str, int], TunedPair]) -> dict:
    dp = rd.entry(ctx, [ctx.dp(K, s, warm=True) for s in ctx.seeds])
    dp["subset_target_by_seed"] = targets(ctx)
    points = {f"{name} H={H}": point(ctx, name, H, t, dp) for (name, H), t in tuned.items()}
    for p in points.values():  # each against fp32 at its H, seed by seed
        base = points.get(f"fp32 H={p['H']}")
        if p.get("val_loss") and base and base.get("val_loss"):
            rd.versus(p, base, "vs_fp32")
    reached = {k: p["bytes_ratio"] for k, p in points.items() if p.get("bytes_ratio") is not None}
    best = min(reached, key=reached.get) if reached else None
    th = ctx.H
    names = ("fp32", "topk50", "topk50_ef")  # part codec's runs: from scratch, lr 0.7
    codec = {n: [ctx.diloco(s, extra=tuple(rd.CODECS[n])) for s in ctx.seeds] for n in names}
    fp32 = rd.entry(ctx, codec["fp32"])
    prune = {n: rd.versus(rd.entry(ctx, codec[n]), fp32, "vs_fp32") for n in ("topk50", "topk50_ef")}
    sl3 = pct(points.get(f"sparseloco3 H={th}"))
    tk10 = pct(points.get(f"topk10_ef H={th}"))
    best_ratio = reached.get(best) if best else None
    return {
        "benchmark": "bytes_to_loss",
        "quick": ctx.quick,
        "model": "tiny (quick.toml)" if ctx.quick else ctx.model,
        "workers": K,
        "steps_per_worker": ctx.steps,
        "start": "warm (reproduce_diloco.py part dp's pretrained model, seed 1000 + seed)",
        "hs": list(ctx.hs),
        "seeds_at_target_H": len(ctx.seeds),
        "seeds_elsewhere": 2,
        "dp": dp,
        "baseline": "data parallel as part dp ran it before issue 36's tuning rules (inner lr 1e-3, "
        "30 warm-up steps); DiLoCo's outer lr is tuned on seed 0 and the validation split, as part dp "
        "did then. The target of each run is data parallel's final loss on the fixed eval subset "
        "of the same seed (`dp.subset_target_by_seed`), which the runs' curves score",
        "dp_final_val_loss": rd.mean(dp),
        "dp_bytes_sent_per_worker": dp.get("bytes_sent_per_worker"),
        "points": points,
        "frontier": frontier(list(points.values())),
        "best_bytes_ratio": best_ratio,
        "best_bytes_ratio_inverse": round(1 / best_ratio) if best_ratio else None,
        "best_run": best,
        "sparseloco_vs_fp32_pct_H50": sl3,
        "sparseloco1_vs_fp32_pct_H50": pct(points.get(f"sparseloco1 H={th}")),
        "chunked_topk10_ef_vs_fp32_pct": tk10,
        "pruning": {"fp32": fp32, **prune},
        "pruning_half_vs_fp32_pct": pct(prune["topk50"]),
        "pruning_half_ef_vs_fp32_pct": pct(prune["topk50_ef"]),
        "targets": {
            "sparseloco_at_most_fp32_H50": None if sl3 is None else sl3 <= 0,
            "best_bytes_ratio_at_most_1_3000": None if best_ratio is None else best_ratio <= 1 / 3000,
            "chunked_topk10_ef_within_1pct": None if tk10 is None else abs(tk10) <= 1,
        },
        "note": "ratios are bytes to reach data parallel's final loss ÷ data parallel's bytes "
        "(uploads per worker); vs_fp32 is (x − fp32) / fp32 at the same H, per seed (paired); "
        "pruning_* come from reproduce_diloco.py's part codec (from scratch, outer lr 0.7)",
    }


def plot(result: dict, path: Path) -> bool:
    """Final loss against bytes sent, log axes, one curve per method over H; data parallel a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = plt.subplots(figsize=(8, 5))
    drawn = False
    for i, name in enumerate(METHODS):
        pts = sorted(
            (p["bytes_sent_per_worker"] * K, p["val_loss"]["mean"], p["H"])
            for p in result["points"].values()
            if p["method"] == name and p.get("val_loss") and p.get("bytes_sent_per_worker")
        )
        if not pts:
            continue
        xs, ys, hs = zip(*pts, strict=True)
        ax.plot(xs, ys, "o-", color=f"C{i}", lw=1.2, ms=4, label=name)
        for x, y, h in pts:
            ax.annotate(f"{h}", (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        drawn = True
    dp = result["dp_final_val_loss"]
    if dp is not None and result["dp_bytes_sent_per_worker"]:
        ax.plot([result["dp_bytes_sent_per_worker"] * K], [dp], "k*", ms=10, label="data parallel")
        ax.axhline(dp, color="k", ls=":", lw=1)
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xscale("log")
    ax.set_yscale("log")
    for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        set_formatter(FormatStrFormatter("%.2f"))  # plain losses (a narrow range: minor ticks)
    ax.set_xlabel("bytes sent by all workers (uploads)")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"{K} workers, warm start, outer lr and momentum / β tuned (labels: H)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _names(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    bad = [n for n in names if n not in METHODS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown method {bad}: choose from {', '.join(METHODS)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", type=_names, default=list(METHODS), help=", ".join(METHODS))
    ap.add_argument("--hs", type=rd._ints, help="the H values, a comma list (default 10,50,100,250,500)")
    ap.add_argument("--jobs", type=int, default=2, help="diloco train subprocesses at once (one core each)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and few steps: checks the plumbing")
    ap.add_argument("--workdir", type=Path, help="run folders (default reproduce_diloco.py's)")
    ap.add_argument("--ledger", type=Path, help="the ledger's folder (default reproduce_diloco.py's)")
    ap.add_argument(
        "--out",
        type=Path,
        help="the JSON, its figure beside it (default benchmarks/results/bytes_to_loss.json, docs/figures/)",
    )
    ap.add_argument("--report-only", action="store_true", help="no new runs: the JSON and figure")
    args = ap.parse_args()
    steps = rd.QUICK_STEPS if args.quick else 1000
    args.hs = tuple(args.hs or ((5, 10, 20, 40) if args.quick else HS))
    bad = [h for h in args.hs if h < 1 or steps % h]
    if bad or args.jobs < 1:
        got = ", ".join(map(str, bad)) or "none"
        ap.error(f"every H must divide the {steps} steps per worker (not: {got}); --jobs ≥ 1")
    suffix = "_quick" if args.quick else ""
    args.workdir = args.workdir or rd.RESULTS / f"reproduce{suffix}_runs"
    where = args.workdir if args.quick else rd.RESULTS
    args.ledger = args.ledger or (where / "_ledger" if args.quick else where / "reproduce_ledger")
    out = args.out or where / "bytes_to_loss.json"
    figure = args.workdir / "figures" / "bytes_to_loss.png" if args.quick else FIGURE
    if args.out is not None:  # the figure goes beside a JSON written elsewhere, not into docs/
        figure = out.with_suffix(".png")
    ctx = context(args)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.quick:
        ctx.config_path.write_text(rd.QUICK_CONFIG)
    tuned = plan(ctx, args.methods, args.hs)
    t0 = time.perf_counter()
    dp_runs = [ctx.dp(K, s, warm=True) for s in ctx.seeds]
    if not args.report_only:
        # a ledger row rebuilt by hand has no curve (a reported run) or no subset loss (data
        # parallel's target): such a run (deterministic) runs again, its row then replaced with
        # the same loss and a curve (kept if the run fails)
        for r in [*dp_runs, *(r for t in tuned.values() for r in t.runs(ctx))]:
            row = ctx.ledger.rows.get(r.name)
            if row is None or "failed" in row:
                continue
            if not ctx.curve(r.name)[0] or (r in dp_runs and "final_subset_val_loss" not in row["summary"]):
                _log(f"{r.label}: the ledger's row lacks its curve; it runs again")
                ctx.rerun.add(r.name)
        what = f"{', '.join(args.methods)} × H {args.hs}"
        _log(f"{len(tuned)} points ({what}); {args.jobs} jobs; runs in {args.workdir}")
        scheduler = rd.Scheduler(ctx, lambda *_: None)
        n = scheduler.execute(parts(dp_runs, tuned))
        _log(f"{n} new runs in {time.perf_counter() - t0:.0f} s")
        if scheduler.stopped:
            raise SystemExit("a run was stopped by a signal; the finished runs are in the ledger: run again")
    # runs whose folders finished outside the scheduler (by hand, or before a crash) join the ledger
    for p in parts(dp_runs, tuned).values():
        for r in p.all_runs(ctx):
            ctx.keep(r)
    ctx.ledger.save()
    result = report(ctx, tuned)
    result["figure"] = str(figure.relative_to(ROOT)) if figure.is_relative_to(ROOT) else str(figure)
    if not plot(result, figure):
        result["figure"] = None
    text = json.dumps(result, indent=2)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    _log(f"saved {out}")


if __name__ == "__main__":
    main()
