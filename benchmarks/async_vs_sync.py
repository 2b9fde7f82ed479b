"""Asynchronous Local-SGD as the paper runs it against sync DiLoCo (docs/method.md §2).

Nano GPT, 4 workers at 0.58 / 0.75 / 1.51 / 3.33 simulated seconds per inner step (the public
toy example's profile), H = 50, equal total local steps (4 × rounds × H), three seeds, in three
scenarios:

- `scratch`: from random parameters. sync; async `naive`, `dn` (Algorithm 2 without DyLU);
  `dn_dylu` (Algorithm 2: DN + DyLU from measured speeds, shard sampling, grace period);
  `dn_dylu_oracle` (the same with the true speeds); ablations `dn_dylu_no_grace` and
  `dn_dylu_no_sampling`.
- `warm`: sync and `dn_dylu` fine-tuning one single-worker model pretrained for rounds × H steps
  (`--init-from`), as the paper measures "matches sync".
- `jitter`: sync, `dn_dylu` and `dn_dylu_oracle` with `--speed-jitter 0.1`, where workers
  cannot lock into phase and measured speeds differ from the true ones.

Each method uses its own best outer lr from the sweep (`--sweep-outer-lr`: {0.1, 0.3, 0.5, 0.7,
1.0} for sync, naive, dn, buffer and dn_dylu, seed 0, scratch; saved as results/async_outer_lr.json
and read by the comparison; the dn_dylu variants use dn_dylu's). Prints one JSON object and saves
it, with every run directory, under benchmarks/results/; draws docs/figures/async_vs_sync*.png.

    python benchmarks/async_vs_sync.py --sweep-outer-lr    # 25 runs, ~35 minutes on 2 cores
    python benchmarks/async_vs_sync.py                     # 37 runs, ~55 minutes on 2 cores
    python benchmarks/async_vs_sync.py --seeds 1 --rounds 2 --scenarios scratch   # a quick look

`speedup` = sync's simulated time to reach sync's final subset validation loss ÷ dn_dylu's
simulated time to reach that same loss, read off the periodic evaluations on the fixed subset,
linearly interpolated, averaged over seeds (null unless every seed reaches it). Final losses are
on the whole validation split.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from diloco.cli.plots import plot_runs
from diloco.config import AsyncConfig, DyluConfig, OuterConfig, SimConfig, TrainConfig
from diloco.run.train import train
from diloco.rundir.metrics import read_metrics

SPEEDS = (0.58, 0.75, 1.51, 3.33)
K = 4
NO_DYLU = DyluConfig(enabled=False)  # with Algorithm 2's shard sampling and grace period: fixed H
PAPER_DYLU = DyluConfig(by="steps")  # the paper's DyLU: jobs of H_w steps
# name -> (method, the async settings, DyLU's)
METHODS = {
    "sync": ("diloco", AsyncConfig(), DyluConfig()),
    "naive": ("async", AsyncConfig(rule="naive"), NO_DYLU),
    "dn": ("async", AsyncConfig(), NO_DYLU),
    "buffer": ("async", AsyncConfig(rule="buffer"), NO_DYLU),
    # the paper's form, H_w steps (`--dylu-by steps`; the default for async is now deadlines)
    "dn_dylu": ("async", AsyncConfig(), PAPER_DYLU),
    "dn_dylu_oracle": ("async", AsyncConfig(), DyluConfig(by="steps", oracle=True)),
    "dn_dylu_no_grace": ("async", AsyncConfig(grace_s=0.0), PAPER_DYLU),
    "dn_dylu_no_sampling": ("async", AsyncConfig(shard_sampling=False), PAPER_DYLU),
}
SCENARIOS = {
    "scratch": [
        "sync",
        "naive",
        "dn",
        "dn_dylu",
        "dn_dylu_oracle",
        "dn_dylu_no_grace",
        "dn_dylu_no_sampling",
    ],
    "warm": ["sync", "dn_dylu"],
    "jitter": ["sync", "dn_dylu", "dn_dylu_oracle"],
}
SWEEP_METHODS = ["sync", "naive", "dn", "buffer", "dn_dylu"]
SWEEP_LRS = (0.1, 0.3, 0.5, 0.7, 1.0)
JITTER = 0.1
RESULTS = Path(__file__).parent / "results"
FIGURES = Path(__file__).parent.parent / "docs" / "figures"


def subset_curve(run_dir: Path) -> list[tuple[float, float]]:
    """The run's subset evaluations as (simulated time, validation loss)."""
    evals = [m for m in read_metrics(run_dir) if m["kind"] == "eval" and m["split"] == "subset"]
    return [(m["sim_time_s"], m["val_loss"]) for m in evals]


def time_on_curve(curve: list[tuple[float, float]], target: float) -> float | None:
    """Simulated time at which a (time, loss) curve first reaches `target` (interpolated)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= target:
            if l0 <= target:
                return t0
            return t0 + (l0 - target) / (l0 - l1) * (t1 - t0)
    return None


def time_to_loss(run_dir: Path, target: float) -> float | None:
    """Simulated time at which the subset validation loss first reaches `target` (interpolated)."""
    return time_on_curve(subset_curve(run_dir), target)


def final_subset_loss(run_dir: Path) -> float:
    return subset_curve(run_dir)[-1][1]


def _mean_spread(values: list[float]) -> dict:
    return {
        "mean": round(statistics.fmean(values), 5),
        "min": round(min(values), 5),
        "max": round(max(values), 5),
    }


def _config(
    name: str, seed: int, out: Path, args, *, lr: float, jitter: float = 0.0, init: str = ""
) -> TrainConfig:
    method, server, dylu = METHODS[name]
    return TrainConfig(
        method=method,
        num_workers=K,
        inner_steps=args.inner_steps,
        rounds=args.rounds,
        seed=seed,
        eval_every=args.inner_steps // 2 if method == "async" else 0,
        out=str(out),
        init_from=init,
        outer=OuterConfig(lr=lr),
        sim=SimConfig(speeds=SPEEDS, speed_jitter=jitter, procs=args.procs),
        async_=server,
        dylu=dylu,
    )


def _train(cfg: TrainConfig, label: str) -> dict:
    summary = train(cfg, progress=False)
    print(
        f"{label:40s} val_loss {summary['val_loss']:.4f} sim {summary['sim_time_s']:6.0f}s "
        f"wall {summary['wall_time_s']:4.0f}s",
        flush=True,
    )
    return summary


# -- the outer-lr sweep -----------------------------------------------------------------------
def sweep(args) -> dict:
    runs = args.out / "async_outer_lr_runs"
    started = time.perf_counter()
    table: dict[str, dict[str, float]] = {}
    for name in args.sweep_methods.split(","):
        table[name] = {}
        for lr in SWEEP_LRS:
            run = runs / f"{name}-lr{lr}"
            if not args.analyse_only:
                shutil.rmtree(run, ignore_errors=True)
                _train(_config(name, 0, run, args, lr=lr), f"sweep {name} lr {lr}")
            table[name][str(lr)] = round(json.loads((run / "summary.json").read_text())["val_loss"], 5)
    best = {m: float(min(losses, key=losses.get)) for m, losses in table.items()}
    result = {
        "benchmark": "async_outer_lr",
        "speeds_s_per_step": SPEEDS,
        "num_workers": K,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "seed": 0,
        "outer_lrs": SWEEP_LRS,
        "final_val_loss": table,
        "best_outer_lr": best,
    }
    if not args.analyse_only:
        result["wall_time_s"] = round(time.perf_counter() - started, 1)
    return result


def outer_lrs(path: Path) -> tuple[dict[str, float], str]:
    """Each method's outer lr: the sweep's best (dn_dylu's for its variants), else 0.7."""
    if not path.is_file():
        return dict.fromkeys(METHODS, 0.7), "default 0.7 (no sweep result)"
    best = json.loads(path.read_text())["best_outer_lr"]
    base = {name: "dn_dylu" if name.startswith("dn_dylu") else name for name in METHODS}
    return {name: best.get(base[name], 0.7) for name in METHODS}, path.name


# -- the comparison ---------------------------------------------------------------------------
def compare(args) -> dict:
    runs = args.out / f"{args.tag}_runs"
    lrs, lr_source = outer_lrs(args.out / "async_outer_lr.json")
    scenarios = args.scenarios.split(",")
    started = time.perf_counter()
    pretrain = runs / "pretrain"
    if not args.analyse_only:
        shutil.rmtree(runs, ignore_errors=True)
        if "warm" in scenarios:
            cfg = TrainConfig(
                method="single",
                inner_steps=args.inner_steps,
                rounds=args.rounds,
                seed=1000,
                out=str(pretrain),
            )
            _train(cfg, "pretrain (single worker, seed 1000)")
        for seed in range(args.seeds):
            for scenario in scenarios:
                for name in SCENARIOS[scenario]:
                    cfg = _config(
                        name,
                        seed,
                        runs / scenario / f"{name}-s{seed}",
                        args,
                        lr=lrs[name],
                        jitter=JITTER if scenario == "jitter" else 0.0,
                        init=str(pretrain) if scenario == "warm" else "",
                    )
                    _train(cfg, f"{scenario} seed {seed} {name}")
    result = {
        "benchmark": "async_vs_sync",
        "speeds_s_per_step": SPEEDS,
        "num_workers": K,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "total_local_steps": K * args.rounds * args.inner_steps,
        "seeds": args.seeds,
        "outer_lr": {m: lrs[m] for m in SCENARIOS["scratch"]},
        "outer_lr_source": lr_source,
        "jitter": JITTER,
        "pretrain_steps": args.rounds * args.inner_steps,
    }
    for scenario in scenarios:
        prefix = "" if scenario == "scratch" else f"{scenario}_"
        result.update(analyse(runs / scenario, SCENARIOS[scenario], args.seeds, prefix))
    result["targets"] = targets(result)
    if not args.analyse_only:
        result["wall_time_s"] = round(time.perf_counter() - started, 1)
        figures(runs, scenarios, args.figures)
    return result


def analyse(runs_dir: Path, methods: list[str], seeds: int, prefix: str) -> dict:
    """Every figure of one scenario, read from the runs' summary.json and metrics.jsonl."""
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
        per_seed.append(row)
    means = {m: statistics.fmean(v) for m, v in finals.items()}
    out: dict = {
        **{f"{prefix}{m}_final_val_loss": round(v, 5) for m, v in means.items()},
        **{f"{prefix}{m}_final_val_loss_spread": _mean_spread(v) for m, v in finals.items()},
        **{
            f"{prefix}{m}_vs_sync_pct": round(100 * (v / means["sync"] - 1), 3)
            for m, v in means.items()
            if m != "sync"
        },
    }
    for name in methods:
        if name == "sync":
            continue
        speedups = [row[name]["speedup"] for row in per_seed]
        key = f"{prefix}speedup" if name == "dn_dylu" else f"{prefix}{name}_speedup"
        out[key] = round(statistics.fmean(speedups), 3) if None not in speedups else None
        out[f"{key}_by_seed"] = speedups
    out[f"{prefix}per_seed"] = per_seed
    return out


def targets(r: dict) -> dict:
    """The issue's targets, each with whether it is met (None where not measured)."""

    def within(prefix: str) -> bool | None:
        a, b = r.get(f"{prefix}dn_dylu_final_val_loss"), r.get(f"{prefix}sync_final_val_loss")
        return None if a is None or b is None else a <= 1.01 * b

    def at_least(key: str, value: float) -> bool | None:
        return None if key not in r else r[key] is not None and r[key] >= value

    def within_oracle(prefix: str) -> bool | None:
        a, b = r.get(f"{prefix}dn_dylu_final_val_loss"), r.get(f"{prefix}dn_dylu_oracle_final_val_loss")
        return None if a is None or b is None else a <= 1.005 * b

    naive, dn = r.get("naive_final_val_loss"), r.get("dn_final_val_loss")
    return {
        "dn_dylu_within_1pct_of_sync": within(""),
        "warm_dn_dylu_within_1pct_of_sync": within("warm_"),
        "jitter_dn_dylu_within_1pct_of_sync": within("jitter_"),
        "speedup_at_least_3": at_least("speedup", 3.0),
        "warm_speedup_at_least_3": at_least("warm_speedup", 3.0),
        "jitter_speedup_at_least_2.5": at_least("jitter_speedup", 2.5),
        "naive_worse_than_dn": None if naive is None or dn is None else naive > dn,
        "measured_dylu_within_0.5pct_of_oracle": within_oracle(""),
        "jitter_measured_dylu_within_0.5pct_of_oracle": within_oracle("jitter_"),
    }


def figures(runs: Path, scenarios: list[str], where: Path) -> None:
    """Seed 0 of each scenario against simulated time and against total local steps."""
    for scenario in scenarios:
        names = [n for n in SCENARIOS[scenario] if n != "naive"]  # naive diverges off the axis
        dirs = [runs / scenario / f"{n}-s0" for n in names]
        suffix = "" if scenario == "scratch" else f"_{scenario}"
        for x, tag, words in (("sim_time_s", "", "simulated time"), ("local_steps", "_steps", "local steps")):
            plot_runs(
                dirs,
                x=x,
                out=where / f"async_vs_sync{suffix}{tag}.png",
                labels=names,
                title=f"{scenario}, seed 0: validation loss against {words}",
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--procs", type=int, default=0, help="simulator processes per run (0: one per core)")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated: scratch,warm,jitter"
    )
    parser.add_argument("--sweep-outer-lr", action="store_true", help="run the outer-lr sweep instead")
    parser.add_argument("--sweep-methods", default=",".join(SWEEP_METHODS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, default=FIGURES, help="where the plots go")
    parser.add_argument("--tag", default="async_vs_sync", help="name of the result file and runs folder")
    parser.add_argument("--analyse-only", action="store_true", help="recompute the result from existing runs")
    args = parser.parse_args()
    result = sweep(args) if args.sweep_outer_lr else compare(args)
    name = "async_outer_lr" if args.sweep_outer_lr else args.tag
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
