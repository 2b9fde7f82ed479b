"""Asynchronous methods against sync DiLoCo when worker speeds wander (issue 31; docs/async.md).

The profile of benchmarks/async_vs_sync.py (nano GPT, 4 workers at 0.58 / 0.75 / 1.51 / 3.33
simulated seconds per inner step, H = 50, 8 rounds: 1,600 local steps for every method), with
`--speed-jitter` 0, 0.1 and 0.2 (each job's time per step × 1 + J·U(−1, 1)), five seeds, from
scratch and from a warm start (one single-worker model pretrained for 400 steps, seed 1000).

Methods (`METHODS`): sync DiLoCo; sync DiLoCo with DyLU (`--dylu`: H_w per round from measured
speeds, all sync together; `sync_dylu_time`: each round a deadline); the paper's baselines on
Algorithm 2's framework with a fixed H (shard sampling and the grace period on): naive, poly,
polythres, delay compensation, buffer, DN; DN + DyLU in the paper's form (H_w from measured
speeds, `--dylu-by steps`), also with a grace window sized from the measured spread of arrivals
(`dn_dylu_measured`, `--grace-s measured`); and DN + DyLU with jobs as deadlines that end
together (`--dylu-by time`, async's default).

Each method's outer lr is the best of {0.1, 0.3, 0.5, 0.7, 1.0} on seed 100 (not among the
reported seeds) at jitter 0.1 from scratch (`--sweep`), and is used at every jitter level and in
both scenarios. The grid stops rising once a method diverges and widens past an edge that wins
(halving below 0.1, ×1.4 above 1.0) until the best lies inside it. `--warm-probe` runs the same
seed and jitter from the warm start over {0.5, 0.7, 1.0} (widened the same way) for the methods
named, sync among them, and the report's `warm_lr_probe` says whether the warm-start ranking owes
to lrs tuned from scratch (each method's best against sync's best on that seed). Each finished run adds one
line to the ledger `--out`/async_jitter_ledger.jsonl (its final loss, outer updates, mean
staleness and subset-loss curve over simulated time) and is never run again, so the benchmark
can be stopped and continued across machines by committing the ledger. Every run takes one
thread (about 3.5 minutes on a core of this machine, two runs side by side; about 50 sweep runs,
then 15 per method and scenario: about 12 hours of both cores, so it runs across sessions;
`--report-only` reports what the ledger holds so far). Run
directories go under `--out`/async_jitter_runs (not kept in git).

    python benchmarks/async_jitter.py --sweep                  # the outer-lr sweep (seed 100)
    python benchmarks/async_jitter.py --warm-probe --methods sync,sync_dylu_time,dn_dylu_time
    python benchmarks/async_jitter.py                          # every cell; cached runs reused
    python benchmarks/async_jitter.py --seeds 1 --jitters 0.1 --scenarios scratch   # a quick look

Per method and jitter level it reports the final validation loss (mean, min–max, mean of the
per-seed % vs sync), `speedup` (sync's simulated time to its own final subset loss ÷ the
method's time to that loss; None where the method never reaches it), outer updates applied and
mean staleness; `best_async_method_jJ` is the asynchronous method with the lowest mean loss.
Prints the result as JSON last and writes benchmarks/results/async_jitter.json and one figure
per jitter level (docs/figures/async_jitter_jJ.png, seed 0, from scratch).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from datetime import datetime
from pathlib import Path

from async_vs_sync import SPEEDS, subset_curve, time_on_curve

from diloco.cli.plots import plot_curves
from diloco.config import AsyncConfig, DyluConfig, OuterConfig, SimConfig, TrainConfig
from diloco.run.train import train
from diloco.rundir.metrics import read_metrics

K, H, ROUNDS = 4, 50, 8
FIXED_H = DyluConfig(enabled=False)  # with Algorithm 2's shard sampling and grace period: fixed H
# name -> (method, the async settings, DyLU's)
METHODS = {
    "sync": ("diloco", AsyncConfig(), DyluConfig()),
    "sync_dylu": (
        "diloco",
        AsyncConfig(),
        DyluConfig(enabled=True, by="steps"),
    ),  # H_w per round, all sync together
    "sync_dylu_time": ("diloco", AsyncConfig(), DyluConfig(enabled=True, by="time")),  # rounds as deadlines
    "naive": ("async", AsyncConfig(rule="naive"), FIXED_H),
    "poly": ("async", AsyncConfig(rule="poly"), FIXED_H),
    "polythres": ("async", AsyncConfig(rule="polythres"), FIXED_H),
    "delaycomp": ("async", AsyncConfig(rule="delaycomp"), FIXED_H),
    "buffer": ("async", AsyncConfig(rule="buffer"), FIXED_H),
    "dn": ("async", AsyncConfig(), FIXED_H),
    "dn_dylu": ("async", AsyncConfig(), DyluConfig(by="steps")),  # the paper's form: H_w from measured speeds
    # the paper's form with a grace window spanning the measured spread of arrivals (--grace-s measured)
    "dn_dylu_measured": ("async", AsyncConfig(grace_s="measured"), DyluConfig(by="steps")),
    "dn_dylu_time": ("async", AsyncConfig(), DyluConfig(by="time")),  # jobs as deadlines
}
# Delay compensation with a larger λ, run only when named (`--sweep --methods delaycomp_l5000,...`):
# its correction λ g⊙g⊙(θ_now − θ_pulled) is about λ·|g|·|Δθ| of g, and for nano an outer_grad
# (about lr·H gradients) and the drift are a few thousandths a parameter, so the default λ = 0.5
# changes g by ~1e-5: it is naive. λ of 5e3–5e4 makes it ~0.1–1.
PROBES = {
    f"delaycomp_l{lam}": ("async", AsyncConfig(rule="delaycomp", delaycomp_lambda=float(lam)), FIXED_H)
    for lam in (5000, 50000)
}
DEFAULT_METHODS = list(METHODS)
METHODS.update(PROBES)
JITTERS = (0.0, 0.1, 0.2)
SEEDS = 5
SWEEP_SEED, SWEEP_JITTER, SWEEP_LRS = 100, 0.1, (0.1, 0.3, 0.5, 0.7, 1.0)
SWEEP_MIN_LR, SWEEP_MAX_LR = 0.02, 2.8
WARM_PROBE_LRS = (0.5, 0.7, 1.0)  # --warm-probe: around the sweep's picks (most are 1.0)
PRETRAIN_SEED = 1000
RESULTS = Path(__file__).parent / "results"
FIGURES = Path(__file__).parent.parent / "docs" / "figures"


THREADS = 1  # every run on one core: the same bits on any machine; it may run beside other work


def config(name: str, seed: int, jitter: float, out: Path, lr: float, init: str = "") -> TrainConfig:
    method, rule, dylu = METHODS[name]
    return TrainConfig(
        threads=THREADS,
        method=method,
        num_workers=K,
        inner_steps=H,
        rounds=ROUNDS,
        seed=seed,
        eval_every=H // 2 if method == "async" else 0,
        out=str(out),
        init_from=init,
        outer=OuterConfig(lr=lr),
        sim=SimConfig(speeds=SPEEDS, speed_jitter=jitter),
        async_=rule,
        dylu=dylu,
    )


class Ledger:
    """One JSON line per finished run, keyed by its path under the runs folder; a key already in
    the ledger is not run again (its settings must match, or the ledger is stale: say so)."""

    def __init__(self, path: Path, runs: Path):
        self.path, self.runs = path, runs
        lines = path.read_text().splitlines() if path.is_file() else []
        self.records = {r["run"]: r for r in map(json.loads, filter(None, lines))}

    def key(self, cfg: TrainConfig) -> str:
        """The run's name in the ledger: its directory under the runs folder."""
        return Path(cfg.out).relative_to(self.runs).as_posix()

    def run(self, cfg: TrainConfig, label: str) -> dict:
        key = self.key(cfg)
        settings = {
            "outer_lr": cfg.outer.lr,
            "seed": cfg.seed,
            "speed_jitter": cfg.sim.speed_jitter,
            "threads": cfg.threads,
        }
        if key in self.records:
            record = self.records[key]
            if record["settings"] != settings:
                raise SystemExit(
                    f"{self.path} holds {key} with {record['settings']}, not {settings}: "
                    "delete its line (or the ledger) to run it again with these settings."
                )
            return record
        shutil.rmtree(cfg.out, ignore_errors=True)  # a run stopped midway is started over
        started = time.perf_counter()
        summary = train(cfg, progress=False)
        elapsed = time.perf_counter() - started
        print(f"{label:44s} val_loss {summary['val_loss']:.4f}  ({elapsed:.0f} s)", flush=True)
        record = {
            "run": key,
            "settings": settings,
            "val_loss": summary["val_loss"],
            "outer_updates": summary["outer_updates"],
            "mean_staleness": staleness(Path(cfg.out)),
            "curve": [[round(t, 3), round(loss, 5)] for t, loss in subset_curve(Path(cfg.out))],
            "elapsed_s": round(elapsed, 1),
            "recorded": datetime.now().isoformat(timespec="seconds"),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records[key] = record
        return record


def sweep_one(ledger: Ledger, name: str, warm: bool = False) -> dict[str, float]:
    """One method's final loss per outer lr: the grid in ascending order, stopped once a loss is
    20% above the best so far (it diverged; larger lrs would too), and widened past an edge that
    wins (halved below the smallest, ×1.4 above the largest) until the best is inside the grid.
    `warm`: the warm-start probe, the grid WARM_PROBE_LRS from the warm start by the same rules."""
    folder, grid, init = ("sweep", SWEEP_LRS, None)
    if warm:
        folder, grid, init = ("sweep_warm", WARM_PROBE_LRS, ledger.runs / "pretrain")

    def loss(lr: float) -> float:
        d = ledger.runs / folder / f"{name}-lr{lr}"
        cfg = config(name, SWEEP_SEED, SWEEP_JITTER, d, lr, str(init or ""))
        if init and ledger.key(cfg) not in ledger.records:
            warm_start(init)
        return round(ledger.run(cfg, f"{folder} {name} lr {lr:g}")["val_loss"], 5)

    table: dict[float, float] = {}
    for lr in grid:
        table[lr] = loss(lr)
        if table[lr] > 1.2 * min(table.values()):
            break
    while True:
        best = min(table, key=table.get)
        if best == min(table) and best / 2 >= SWEEP_MIN_LR:
            table[round(best / 2, 4)] = loss(round(best / 2, 4))
        elif best == max(table) and best * 1.4 <= SWEEP_MAX_LR:
            table[round(best * 1.4, 4)] = loss(round(best * 1.4, 4))
        else:
            return {f"{lr:g}": table[lr] for lr in sorted(table)}


def sweep(ledger: Ledger, methods: list[str], lr_file: Path) -> dict:
    """The sweep of `methods`, added to the table of an earlier sweep in `lr_file` (if any), which
    is rewritten after each method (other benchmarks read it: server_async_vs_sync.py)."""
    old = json.loads(lr_file.read_text()) if lr_file.is_file() else {}
    table = old.get("final_val_loss", {})
    for name in methods:
        table[name] = sweep_one(ledger, name)
        result = {
            **old,  # the warm probe's table, if any, stays
            "benchmark": "async_jitter_outer_lr",
            "seed": SWEEP_SEED,
            "jitter": SWEEP_JITTER,
            "outer_lrs": SWEEP_LRS,
            "final_val_loss": table,
            "best_outer_lr": {m: float(min(losses, key=losses.get)) for m, losses in table.items()},
        }
        lr_file.write_text(json.dumps(result, indent=2) + "\n")
    return result


def warm_probe(ledger: Ledger, methods: list[str], lr_file: Path) -> dict:
    """The warm-start lr probe of `methods` (`--warm-probe`), kept in `lr_file` under
    `warm_probe`: the same seed and jitter as the sweep, from the warm start. The reported runs
    keep the sweep's lrs; the probe tells whether the warm-start ranking owes to them."""
    result = json.loads(lr_file.read_text())
    probe = result.setdefault("warm_probe", {"outer_lrs": WARM_PROBE_LRS, "final_val_loss": {}})
    for name in methods:
        probe["final_val_loss"][name] = sweep_one(ledger, name, warm=True)
        lr_file.write_text(json.dumps(result, indent=2) + "\n")
    return result


def probe_table(lr_file: dict) -> dict | None:
    """Per probed method: its best warm lr and loss, the loss at the sweep's (scratch) lr where the
    probe ran it, and its best loss against sync's best (%) on the probe's seed."""
    probe = lr_file.get("warm_probe", {}).get("final_val_loss", {})
    if "sync" not in probe:
        return None
    best = {m: min(losses.values()) for m, losses in probe.items()}
    return {
        m: {
            "best_outer_lr": float(min(losses, key=losses.get)),
            "best_val_loss": best[m],
            "scratch_lr": lr_file["best_outer_lr"][m],
            "val_loss_at_scratch_lr": losses.get(f"{lr_file['best_outer_lr'][m]:g}"),
            "best_vs_sync_best_pct": round(100 * (best[m] / best["sync"] - 1), 3),
            "final_val_loss": losses,
        }
        for m, losses in probe.items()
    }


def staleness(run_dir: Path) -> float | None:
    stale = [m["staleness"] for m in read_metrics(run_dir) if m["kind"] == "worker"]
    return round(statistics.fmean(stale), 3) if stale else None


def cell(records: dict[str, dict], methods: list[str], seeds: list[int]) -> dict:
    """Every figure of one jitter level and scenario, from its runs' ledger records by name."""
    per: dict[str, dict[str, list]] = {
        m: {"loss": [], "pct": [], "speedup": [], "updates": [], "stale": []} for m in methods
    }
    for seed in seeds:
        sync = records[f"sync-s{seed}"]
        target = sync["curve"][-1][1]  # sync's final subset loss
        sync_t = time_on_curve(sync["curve"], target)
        for name in methods:
            r = records[f"{name}-s{seed}"]
            p = per[name]
            p["loss"].append(r["val_loss"])
            p["pct"].append(100 * (r["val_loss"] / sync["val_loss"] - 1))
            p["updates"].append(r["outer_updates"])
            p["stale"].append(r["mean_staleness"])
            t = time_on_curve(r["curve"], target)
            p["speedup"].append(round(sync_t / t, 3) if t else None)
    out = {}
    for name, p in per.items():
        speedups = p["speedup"]
        out[name] = {
            "val_loss": {
                "mean": round(statistics.fmean(p["loss"]), 5),
                "min": round(min(p["loss"]), 5),
                "max": round(max(p["loss"]), 5),
            },
            "val_loss_by_seed": [round(x, 5) for x in p["loss"]],
            "vs_sync_pct": round(statistics.fmean(p["pct"]), 3),
            "vs_sync_pct_by_seed": [round(x, 3) for x in p["pct"]],
            "speedup_by_seed": speedups,
            "min_speedup": None if None in speedups else min(speedups),
            "outer_updates_mean": statistics.fmean(p["updates"]),
            "mean_staleness": None if None in p["stale"] else round(statistics.fmean(p["stale"]), 3),
        }
    return out


def warm_start(pretrain: Path) -> None:
    """The warm start (one worker, 400 steps, seed 1000): deterministic, so made again on a
    machine that lacks it."""
    if (pretrain / "summary.json").is_file():
        return
    shutil.rmtree(pretrain, ignore_errors=True)
    single = TrainConfig(
        method="single", inner_steps=H, rounds=ROUNDS, seed=PRETRAIN_SEED, out=str(pretrain), threads=THREADS
    )
    train(single, progress=False)


# issue 31: the best async method ≤ +1% vs sync, with a speedup ≥ 2.5 on every seed
TARGET_PCT, TARGET_SPEEDUP = 1.0, 2.5
TARGET_JITTERS = (0.1, 0.2)


TIE_PCT = 0.5  # mean losses this close (in %) count as equal: the faster method is the pick


def recommend(table: dict) -> str:
    """The method to pick at one jitter level: among those that reach sync's final loss on every
    seed (sync itself always does) and end within TIE_PCT % of the lowest mean loss of them, the
    one with the largest smallest-per-seed speedup."""
    reached = [m for m in table if table[m]["min_speedup"] is not None]
    best = min(table[m]["val_loss"]["mean"] for m in reached)
    close = [m for m in reached if table[m]["val_loss"]["mean"] <= best * (1 + TIE_PCT / 100)]
    return max(close, key=lambda m: table[m]["min_speedup"])


def targets(result: dict, seeds: int) -> dict:
    """Issue 31's targets at jitter 0.1 and 0.2, in each scenario that has a report: the best
    asynchronous method's mean paired % vs sync and its smallest per-seed speedup."""
    out = {}
    for prefix in ("", "warm_"):
        for j in TARGET_JITTERS:
            cell = f"{prefix}j{j:g}"
            if f"{prefix}best_async_method_j{j:g}" not in result:
                continue
            pct = result[f"{prefix}best_async_vs_sync_pct_j{j:g}"]
            speedup = result[f"{prefix}best_async_min_speedup_j{j:g}"]
            out[cell] = {
                "method": result[f"{prefix}best_async_method_j{j:g}"],
                "seeds": len(result[f"{prefix}seeds_j{j:g}"]),
                "loss_met": pct <= TARGET_PCT,
                "speedup_met": speedup is not None and speedup >= TARGET_SPEEDUP,
            }
    met = all(c["loss_met"] and c["speedup_met"] and c["seeds"] >= seeds for c in out.values())
    met = met and len(out) == 2 * len(TARGET_JITTERS)
    return {"target_pct": TARGET_PCT, "target_speedup": TARGET_SPEEDUP, "cells": out, "met": met}


def compare(args, ledger: Ledger, lrs: dict[str, float]) -> dict:
    """Every cell's runs (from the ledger where they ran before) and its figures. With
    `args.report_only` nothing runs: a cell is reported over the seeds whose runs are all in the
    ledger, and cells with none are left out (`runs_missing` counts what is still to run)."""
    seeds = list(range(args.seeds))
    methods = list(dict.fromkeys(["sync", *args.methods.split(",")]))  # sync: every figure's baseline
    pretrain = ledger.runs / "pretrain"
    result: dict = {
        "benchmark": "async_jitter",
        "speeds_s_per_step": SPEEDS,
        "num_workers": K,
        "inner_steps": H,
        "rounds": ROUNDS,
        "total_local_steps": K * ROUNDS * H,
        "seeds": seeds,
        "jitters": args.jitters,
        "scenarios": args.scenarios,
        "outer_lr": {m: lrs[m] for m in methods},
    }
    missing = 0
    for scenario in args.scenarios:
        init = str(pretrain) if scenario == "warm" else ""
        for j in args.jitters:
            where = ledger.runs / scenario / f"j{j:g}"
            records, done = {}, []
            for seed in seeds:
                for name in methods:
                    cfg = config(name, seed, j, where / f"{name}-s{seed}", lrs[name], init)
                    if ledger.key(cfg) not in ledger.records:
                        if args.report_only:
                            missing += 1
                            continue
                        if init:
                            warm_start(pretrain)
                    records[f"{name}-s{seed}"] = ledger.run(cfg, f"{scenario} j{j:g} seed {seed} {name}")
                if all(f"{name}-s{seed}" in records for name in methods):
                    done.append(seed)
            if not done:
                continue
            table = cell(records, methods, done)
            prefix = "" if scenario == "scratch" else "warm_"
            result[f"{prefix}j{j:g}"] = table
            result[f"{prefix}seeds_j{j:g}"] = done
            result[f"{prefix}recommended_j{j:g}"] = recommend(table)
            asyn = [m for m in methods if METHODS[m][0] == "async"]
            if asyn:
                best = min(asyn, key=lambda m: table[m]["val_loss"]["mean"])
                result[f"{prefix}best_async_method_j{j:g}"] = best
                result[f"{prefix}best_async_vs_sync_pct_j{j:g}"] = table[best]["vs_sync_pct"]
                result[f"{prefix}best_async_min_speedup_j{j:g}"] = table[best]["min_speedup"]
            if "sync_dylu" in table:
                result[f"{prefix}sync_dylu_vs_sync_pct_j{j:g}"] = table["sync_dylu"]["vs_sync_pct"]
                result[f"{prefix}sync_dylu_min_speedup_j{j:g}"] = table["sync_dylu"]["min_speedup"]
            if scenario == "scratch" and args.figures is not None and done[0] == 0:
                shown = [m for m in methods if m != "naive"]  # naive diverges off the axis
                plot_curves(
                    [tuple(zip(*records[f"{m}-s0"]["curve"], strict=True)) for m in shown],
                    shown,
                    axis_label="simulated time (s)",
                    out=args.figures / f"async_jitter_j{j:g}.png",
                    title=f"speed jitter {j:g}, seed 0: validation loss against simulated time",
                    ymax=3.0,  # from scratch the curves start at 5.5: the part that differs is below 3
                )
    result["runs_missing"] = missing
    result["targets"] = targets(result, len(seeds))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="run the outer-lr sweep (seed 100)")
    parser.add_argument(
        "--warm-probe",
        action="store_true",
        help="the sweep's seed and jitter from the warm start, lrs around the picks (needs sync)",
    )
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--jitters", type=lambda s: [float(x) for x in s.split(",")], default=list(JITTERS))
    parser.add_argument("--scenarios", type=lambda s: s.split(","), default=["scratch", "warm"])
    parser.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS), help=f"also: {', '.join(PROBES)} (λ probes)"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the seeds whose runs are all in the ledger",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, default=FIGURES)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lr_file = args.out / "async_jitter_outer_lr.json"
    ledger = Ledger(args.out / "async_jitter_ledger.jsonl", args.out / "async_jitter_runs")
    if (args.sweep or args.warm_probe) and args.report_only:
        parser.error("--sweep and --warm-probe run, and --report-only runs nothing: give one of them")
    if args.sweep and args.warm_probe:
        parser.error("--sweep and --warm-probe are two runs of their own: give one of them")
    if args.sweep:
        result = sweep(ledger, args.methods.split(","), lr_file)
        name = lr_file.name
    else:
        if not lr_file.is_file():
            parser.error(f"no outer-lr sweep at {lr_file}: run with --sweep first")
        if args.warm_probe:
            result = warm_probe(ledger, args.methods.split(","), lr_file)
            name = lr_file.name
        else:
            lr_table = json.loads(lr_file.read_text())
            result = compare(args, ledger, lr_table["best_outer_lr"])
            if (probe := probe_table(lr_table)) is not None:
                result["warm_lr_probe"] = probe
            name = "async_jitter.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
