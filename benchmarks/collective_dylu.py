"""Sync DiLoCo with DyLU under torchrun (issue 31): two ranks, rank 1 an emulated device 3×
slower (`--slowdown 1:3@0-inf`: each of its inner steps padded to 3× its measured time), plain
sync DiLoCo against `--dylu` at the same total inner steps (2 × rounds × H).

Plain sync waits every round for the slow worker; with DyLU it takes ⌊H/3⌋ steps to the fast
one's H and both sync together. Reported: `dylu_wall_ratio` (DyLU's training wall time ÷ plain
sync's; evaluation excluded, since DyLU runs more rounds and evaluates after each; target ≤ 0.6)
and `dylu_loss_gap_pct` (final validation loss, % above plain sync's; target within 1%), the
median over `--repeats` pairs run back to back in alternating order.

    python benchmarks/collective_dylu.py          # ~4 minutes on 2 cores; run it alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def run(out: Path, args, dylu: bool) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "diloco", "train", "--runtime", "collective", "--threads", "1", "--no-progress"]
    cmd += ["--inner-steps", str(args.inner_steps), "--rounds", str(args.rounds), "--seed", str(args.seed)]
    cmd += ["--slowdown", f"1:{args.slowdown:g}@0-inf", "--out", str(out)] + (["--dylu"] if dylu else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed ({'dylu' if dylu else 'plain'}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x.get("steps") for x in lines if x["kind"] == "inner"]
    return {
        "train_wall_s": summary["wall_time_s"] - summary["eval_time_s"],
        "val_loss": summary["val_loss"],
        "outer_updates": summary["outer_updates"],
        "inner_steps": summary["inner_steps"],
        "steps_by_worker_per_round": [steps[i : i + 2] for i in range(0, len(steps), 2)] if dylu else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "collective_dylu.json")
    args = parser.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = [False, True] if r % 2 == 0 else [True, False]
            got = {dylu: run(Path(tmp) / f"r{r}-{'dylu' if dylu else 'plain'}", args, dylu) for dylu in order}
            pairs.append({"plain": got[False], "dylu": got[True]})
            print(json.dumps(pairs[-1]), file=sys.stderr, flush=True)
    ratios = [p["dylu"]["train_wall_s"] / p["plain"]["train_wall_s"] for p in pairs]
    gaps = [100 * (p["dylu"]["val_loss"] / p["plain"]["val_loss"] - 1) for p in pairs]
    result = {
        "benchmark": "collective_dylu",
        "workers": 2,
        "slowdown_of_worker_1": args.slowdown,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "total_inner_steps": 2 * args.rounds * args.inner_steps,
        "dylu_wall_ratio": round(statistics.median(ratios), 4),
        "dylu_wall_ratio_by_repeat": [round(x, 4) for x in ratios],
        "dylu_loss_gap_pct": round(statistics.median(gaps), 3),
        "dylu_loss_gap_pct_by_repeat": [round(x, 3) for x in gaps],
        "targets": {"dylu_wall_ratio": "<= 0.6", "dylu_loss_gap_pct": "<= 1"},
        "runs": pairs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
