"""Sync DiLoCo against asynchronous Local-SGD (the paper's Algorithm 2 with diloco's defaults) and
against sync DiLoCo with DyLU, on the real parameter server: `diloco serve` and 4 `diloco worker`
processes on this machine, made heterogeneous with `--slowdown` 1, 1.3, 2.6 and 5.7 (each inner
step padded to F × its measured time), equal total local steps (k × rounds × H), evaluated on
the server every k × H steps, over `--seeds` seeds (default 3).

Every run uses the defaults, no grace or DyLU flag set by hand: async is `--method async` (DN,
DyLU with jobs as deadlines, `--grace-s auto`: a tenth of a job, recorded as `grace_auto_s`);
sync + DyLU is `--method diloco --dylu`. Per seed: `*_loss_ratio` = final validation loss (whole
split) ÷ sync's, `*_wall_speedup` = sync's wall time to reach sync's final subset loss ÷ the
method's (None where it never does). Targets: async loss ratio ≤ 1.01 and wall speedup ≥ 2.5 on
every seed. Per run it also reports, from the write-ahead log, the size of each update group
(`group_sizes`, `mean_group_size`: 4 when every grace window holds all workers) and how late
deadline jobs' pushes land (`lateness_s`). Each method's outer lr is its best in the simulator's sweep
(results/async_jitter_outer_lr.json: sync, dn_dylu_time, sync_dylu), else 0.7.

    python benchmarks/server_async_vs_sync.py            # ~30 minutes on 2 cores; run it alone
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SLOWDOWNS = (1.0, 1.3, 2.6, 5.7)
RESULTS = Path(__file__).parent / "results"


# method here -> (its name in the simulator's sweep, diloco serve's flags)
METHODS = {
    "sync": ("sync", ("--method", "diloco")),
    "async": ("dn_dylu_time", ("--method", "async")),
    "sync_dylu": ("sync_dylu", ("--method", "diloco", "--dylu")),
}


def _outer_lrs() -> dict[str, float]:
    """Each method's best outer lr from the simulator's sweep (async_jitter.py), else 0.7."""
    path = RESULTS / "async_jitter_outer_lr.json"
    swept = json.loads(path.read_text()).get("best_outer_lr", {}) if path.exists() else {}
    return {m: float(swept.get(name, 0.7)) for m, (name, _) in METHODS.items()}


def run(flags: tuple[str, ...], args, seed: int, out: Path, outer_lr: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DILOCO_TOKEN": secrets.token_urlsafe(32)}
    cmd = [sys.executable, "-m", "diloco", "serve", "--out", str(out), "--port", "0", "--threads", "1",
           *flags, "--workers", str(len(SLOWDOWNS)), "--inner-steps", str(args.inner_steps),
           "--rounds", str(args.rounds), "--seed", str(seed), "--outer-lr", str(outer_lr),
           "--no-progress"]  # fmt: skip
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (out / "server.json").exists():
        if server.poll() is not None:
            raise SystemExit(f"the server failed: {server.stderr.read()}")
        time.sleep(0.1)
    address = json.loads((out / "server.json").read_text())["address"]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "diloco",
                "worker",
                "--server",
                address,
                "--threads",
                "1",
                "--slowdown",
                str(f),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for f in SLOWDOWNS
    ]
    for p in (server, *workers):
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"a process failed ({p.returncode}): {err[-2000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    evals = [(x["wall_time_s"], x["val_loss"]) for x in lines if x["kind"] == "eval" and x["split"] != "full"]
    return {
        "flags": list(flags),
        "outer_lr": outer_lr,
        "final_val_loss": summary["val_loss"],
        "final_subset_val_loss": summary["final_subset_val_loss"],
        "wall_time_s": summary["wall_time_s"],
        "process_wall_s": time.perf_counter() - t0,
        "outer_updates": summary["outer_updates"],
        "inner_steps": summary["inner_steps"],
        "workers": summary["workers"],
        "evals": evals,
        **grace_groups(out),
    }


def grace_groups(run_dir: Path) -> dict:
    """From the write-ahead log's events: how many pushes each update group held (the applies
    between two rounds of hand-outs) and how late deadline jobs' pushes landed (push time −
    (hand-out + seconds); negative: early)."""
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    jobs, sizes, group, late = {}, [], 0, []
    for e in events:
        if e["kind"] == "dispatch":
            jobs[e["job"]] = e
            if group:
                sizes, group = [*sizes, group], 0
        elif e["kind"] == "apply":
            group += 1
        elif e["kind"] == "push" and jobs[e["job"]].get("seconds"):
            job = jobs[e["job"]]
            late.append(e["t"] - job["t"] - job["seconds"])
    late.sort()

    def q(f: float) -> float | None:
        return round(late[min(len(late) - 1, int(f * len(late)))], 3) if late else None

    return {
        "group_sizes": sizes,
        "mean_group_size": round(sum(sizes) / len(sizes), 3) if sizes else None,
        "lateness_s": {"p50": q(0.5), "p90": q(0.9), "max": q(1.0)},
    }


def first_time_at(evals: list[tuple[float, float]], loss: float) -> float | None:
    return next((t for t, v in evals if v <= loss), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    lrs = _outer_lrs()
    tmp = Path(tempfile.mkdtemp(prefix="diloco-server-bench-"))
    per_seed = []
    for seed in range(args.seeds):
        runs = {}
        for m, (_, flags) in METHODS.items():
            runs[m] = run(flags, args, seed, tmp / f"{m}-s{seed}", lrs[m])
            line = (
                f"seed {seed} {m}: val_loss {runs[m]['final_val_loss']:.4f} in {runs[m]['wall_time_s']:.0f} s"
            )
            print(line, file=sys.stderr, flush=True)
        sync = runs["sync"]
        target = sync["final_subset_val_loss"]
        t_sync = first_time_at(sync["evals"], target)
        row = {"seed": seed, "sync_time_to_target_s": t_sync, "runs": runs}
        for m in ("async", "sync_dylu"):
            t = first_time_at(runs[m]["evals"], target)
            row[f"{m}_loss_ratio"] = runs[m]["final_val_loss"] / sync["final_val_loss"]
            row[f"{m}_wall_speedup"] = t_sync / t if t_sync and t else None
            row[f"{m}_total_wall_ratio"] = sync["wall_time_s"] / runs[m]["wall_time_s"]
        # what `--grace-s auto` waited: a tenth of H × the fastest measured seconds per step
        row["grace_auto_s"] = round(
            0.1 * args.inner_steps * min(w["step_s"] for w in runs["async"]["workers"]), 3
        )
        row["async_mean_group_size"] = runs["async"]["mean_group_size"]
        per_seed.append(row)

    def by_seed(key: str) -> list:
        return [None if r[key] is None else round(r[key], 4) for r in per_seed]

    result = {
        "benchmark": "server_async_vs_sync",
        "slowdowns": SLOWDOWNS,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "seeds": list(range(args.seeds)),
        "outer_lr": lrs,
        "async_loss_ratio_by_seed": by_seed("async_loss_ratio"),
        "wall_speedup_by_seed": by_seed("async_wall_speedup"),
        "sync_dylu_loss_ratio_by_seed": by_seed("sync_dylu_loss_ratio"),
        "sync_dylu_wall_speedup_by_seed": by_seed("sync_dylu_wall_speedup"),
        "grace": {"setting": "auto", "seconds_by_seed": [r["grace_auto_s"] for r in per_seed]},
        "async_mean_group_size_by_seed": [r["async_mean_group_size"] for r in per_seed],
        "async_meets_targets": all(
            r["async_loss_ratio"] <= 1.01 and (r["async_wall_speedup"] or 0) >= 2.5 for r in per_seed
        ),
        "target_loss_ratio": 1.01,
        "target_wall_speedup": 2.5,
        "per_seed": per_seed,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_seed"}, indent=2))
    (RESULTS / "server_async_vs_sync.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
