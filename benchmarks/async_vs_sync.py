"""Asynchronous Local-SGD against sync DiLoCo with heterogeneous workers (ALGORITHMS.md §2).

Nano GPT, 4 workers with per-step costs 0.58 / 0.75 / 1.51 / 3.33 simulated seconds, equal total
inner steps (4 × rounds × H), three seeds. Methods: sync DiLoCo, async `naive`, async `dn`,
async `dn` + DyLU (measured speeds), async `buffer` (N = 4). Prints one JSON object and saves it,
with every run directory, under benchmarks/results/.

    python benchmarks/async_vs_sync.py              # ~25 minutes on 2 cores
    python benchmarks/async_vs_sync.py --seeds 1 --rounds 2   # a quick look

`speedup` = sync's simulated time to reach sync's final validation loss ÷ DN+DyLU's simulated
time to reach that same loss, both read off the periodic evaluations on the fixed validation
subset, linearly interpolated between evaluations. Final losses are on the whole validation split.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from diloco.config import ServerConfig, SimConfig, TrainConfig
from diloco.metrics import read_metrics
from diloco.train import train

SPEEDS = (0.58, 0.75, 1.51, 3.33)
METHODS = {
    "sync": ("diloco", ServerConfig()),
    "naive": ("async", ServerConfig(rule="naive")),
    "dn": ("async", ServerConfig(rule="dn")),
    "dn_dylu": ("async", ServerConfig(rule="dn", dylu=True)),
    "buffer": ("async", ServerConfig(rule="buffer")),
}
# Not in the default set (the five): variants for follow-up experiments (--methods).
EXTRA = {
    "dn_dylu_sampling": ("async", ServerConfig(rule="dn", dylu=True, shard_sampling=True)),
    "dn_dylu_oracle": ("async", ServerConfig(rule="dn", dylu_oracle=True)),
}


def time_to_loss(run_dir: Path, target: float) -> float | None:
    """Simulated time at which the subset validation loss first reaches `target` (interpolated)."""
    evals = [m for m in read_metrics(run_dir) if m["kind"] == "eval" and m["split"] == "subset"]
    for prev, cur in zip(evals, evals[1:], strict=False):
        if cur["val_loss"] <= target:
            if prev["val_loss"] <= target:
                return prev["sim_time_s"]
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - cur["val_loss"])
            return prev["sim_time_s"] + frac * (cur["sim_time_s"] - prev["sim_time_s"])
    return None


def final_subset_loss(run_dir: Path) -> float:
    evals = [m for m in read_metrics(run_dir) if m["kind"] == "eval" and m["split"] == "subset"]
    return evals[-1]["val_loss"]


def _mean_spread(values: list[float]) -> dict:
    return {
        "mean": round(statistics.fmean(values), 5),
        "min": round(min(values), 5),
        "max": round(max(values), 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, from {', '.join([*METHODS, *EXTRA])}; sync is always run",
    )
    parser.add_argument("--tag", default="async_vs_sync", help="name of the result file and runs folder")
    parser.add_argument("--analyse-only", action="store_true", help="recompute the result from existing runs")
    args = parser.parse_args()
    chosen = ["sync"] + [m for m in args.methods.split(",") if m != "sync"]
    methods = {m: {**METHODS, **EXTRA}[m] for m in chosen}
    runs_dir = args.out / f"{args.tag}_runs"
    started = time.perf_counter()
    if not args.analyse_only:
        shutil.rmtree(runs_dir, ignore_errors=True)
        for seed in range(args.seeds):
            for name in methods:
                _run(name, seed, runs_dir, args)
    result = {
        "benchmark": "async_vs_sync",
        "speeds_s_per_step": SPEEDS,
        "num_workers": 4,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "total_inner_steps": 4 * args.rounds * args.inner_steps,
        "seeds": args.seeds,
        **analyse(runs_dir, list(methods), args.seeds),
        "targets": {"dn_dylu_within_pct_of_sync": 1.0, "speedup": 2.5, "naive_worse_than_dn": True},
    }
    if not args.analyse_only:
        result["wall_time_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(result, indent=2) + "\n")


def _run(name: str, seed: int, runs_dir: Path, args) -> None:
    method, server = {**METHODS, **EXTRA}[name]
    cfg = TrainConfig(
        method=method,
        num_workers=4,
        inner_steps=args.inner_steps,
        rounds=args.rounds,
        seed=seed,
        eval_every=args.inner_steps // 2 if method == "async" else 0,
        out=str(runs_dir / f"{name}-s{seed}"),
        sim=SimConfig(speeds=SPEEDS),
        server=server,
    )
    summary = train(cfg, progress=False)
    print(
        f"seed {seed} {name:8s} val_loss {summary['val_loss']:.4f} "
        f"sim {summary['sim_time_s']:.0f}s wall {summary['wall_time_s']:.0f}s",
        flush=True,
    )


def analyse(runs_dir: Path, methods: list[str], seeds: int) -> dict:
    """Every figure of the result, read from the runs' summary.json and metrics.jsonl."""
    finals: dict[str, list[float]] = {m: [] for m in methods}
    per_seed = []
    for seed in range(seeds):
        row: dict = {"seed": seed}
        sync_dir = runs_dir / f"sync-s{seed}"
        target = final_subset_loss(sync_dir)
        sync_t = time_to_loss(sync_dir, target)
        for name in methods:
            run = runs_dir / f"{name}-s{seed}"
            summary = json.loads((run / "summary.json").read_text())
            finals[name].append(summary["val_loss"])
            row[name] = {
                "val_loss": round(summary["val_loss"], 5),
                "sim_time_s": round(summary["sim_time_s"], 1),
                "outer_updates": summary["outer_updates"],
                "wall_time_s": summary["wall_time_s"],
            }
            if name != "sync":
                t = time_to_loss(run, target)
                row[name]["speedup"] = round(sync_t / t, 3) if t else None
                # The other way round: how much sooner it reaches its own final loss than sync does.
                own = final_subset_loss(run)
                t_own, t_sync = time_to_loss(run, own), time_to_loss(sync_dir, own)
                row[name]["speedup_at_own_final"] = round(t_sync / t_own, 3) if t_own and t_sync else None
        per_seed.append(row)
    means = {m: statistics.fmean(v) for m, v in finals.items()}
    speedups = [row.get("dn_dylu", {}).get("speedup") for row in per_seed]
    reached = [x for x in speedups if x is not None]
    own = [row.get("dn_dylu", {}).get("speedup_at_own_final") for row in per_seed]
    return {
        **{f"{m}_final_val_loss": round(v, 5) for m, v in means.items()},
        **{f"{m}_final_val_loss_spread": _mean_spread(v) for m, v in finals.items()},
        "speedup": round(statistics.fmean(reached), 3) if reached and len(reached) == len(speedups) else None,
        "speedup_by_seed": speedups,
        "dn_dylu_speedup_at_own_final_by_seed": own,
        **{
            f"{m}_vs_sync_loss_gap_pct": round(100 * (v / means["sync"] - 1), 3)
            for m, v in means.items()
            if m != "sync"
        },
        "naive_worse_than_dn": means["naive"] > means["dn"] if {"naive", "dn"} <= means.keys() else None,
        "per_seed": per_seed,
    }


if __name__ == "__main__":
    main()
