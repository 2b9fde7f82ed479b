"""Bytes to quality: how many bytes DiLoCo needs to reach data parallel's final validation loss,
for each communication interval H and outer_grad codec, on the same model and data.

Data parallel (`--method dp`, k workers, `--steps` T steps of a k× batch, one gradient-sized
message per worker per step) sets the target: its final validation loss on the fixed eval subset.
Each DiLoCo run (k workers) may run up to 2T inner steps per worker; from its eval curve (every
round) we read the bytes its workers had sent when it first reached the target, and the ratio to
data parallel's bytes. Runs that never reach it say so (`reached: false`). Bytes are uploads,
summed over workers, the real message sizes of each codec.

JSON: `dp_final_val_loss`, `dp_bytes_sent`, per run `final_val_loss`, `bytes_sent`,
`bytes_to_target`, `bytes_ratio` (to dp's bytes), `steps_to_target`; `best_bytes_ratio` (the
smallest ratio of any run that reached the target; target ≤ 1/1000); and at equal compute (the
same 2T steps at H = 50) each codec's final loss against fp32 (`loss_gap` per codec;
`fp4_ef_loss_gap` for fp4 with error feedback, target ≤ 0.005). A figure of loss against bytes
goes to docs/figures/bytes_to_loss.png. Losses are deterministic for a seed (no timing), so
the benchmark may share the machine; it takes ~55 minutes on 2 cores with the defaults.

    python benchmarks/bytes_to_loss.py                 # T = 500, k = 4, H in 50, 100, 250
    python benchmarks/bytes_to_loss.py --quick         # a few minutes, tiny: checks the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIGURE = ROOT / "docs" / "figures" / "bytes_to_loss.png"

# name -> extra flags; the H = 50 sweep runs all, the other H values the first and the last
CODECS = {
    "fp32": [],
    "bf16": ["--codec", "bf16"],
    "int8": ["--codec", "int8"],
    "fp4": ["--codec", "fp4"],
    "topk_ef": ["--codec", "topk", "--topk-fraction", "0.1", "--error-feedback"],
    "int8_ef": ["--codec", "int8", "--error-feedback"],
    "fp4_ef": ["--codec", "fp4", "--error-feedback"],
    "fp4_ef_bf16_download": ["--codec", "fp4", "--error-feedback", "--download-codec", "bf16"],
}


def _log(text: str) -> None:
    print(f"[bytes_to_loss] {text}", file=sys.stderr, flush=True)


def _train(out: Path, flags: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "diloco", "train", "--out", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if x["kind"] == "eval" and x.get("split", "subset") == "subset"]
    summary = json.loads((out / "summary.json").read_text())
    return {"evals": evals, "summary": summary}


def _to_target(evals: list[dict], target: float) -> tuple[int | None, int | None]:
    for e in evals:
        if e["val_loss"] <= target:
            return e["bytes_sent"], e["inner_step"]
    return None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500, help="data parallel's steps T (DiLoCo: up to 2T)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--hs", default="50,100,250", help="communication intervals H")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny model and few steps: checks the plumbing")
    ap.add_argument("--out", type=Path, default=RESULTS / "bytes_to_loss.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from --out's JSON")
    args = ap.parse_args()
    if args.plot_only:
        _plot(json.loads(args.out.read_text()))
        return
    hs = [int(h) for h in args.hs.split(",")]
    common = ["--workers", str(args.workers), "--seed", str(args.seed)]
    if args.quick:
        args.steps, hs = 20, [5, 10]
        common += ["--seq-len", "32", "--batch-size", "4"]
    T = args.steps
    if any((2 * T) % h for h in hs) or T % 50 and not args.quick:
        raise SystemExit(f"--steps {T} must be a multiple of 50 and 2T of every H in {hs}")
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bytes_to_loss-"))
    eval_h = 10 if args.quick else 50
    _log(f"data parallel: {args.workers} workers, {T} steps")
    dp = _train(
        work / "dp",
        [
            *common,
            "--method",
            "dp",
            "--inner-steps",
            str(eval_h),
            "--rounds",
            str(T // eval_h),
            "--threads",
            "2",
        ],
    )
    target = dp["summary"]["final_subset_val_loss"]
    dp_bytes = dp["summary"]["bytes_sent"]
    _log(f"data parallel: final subset val loss {target:.4f}, {dp_bytes / 1e6:.1f} MB sent")
    runs = {}
    plan = [(h, name) for h in hs for name in (CODECS if h == hs[0] else ("fp32", "fp4_ef"))]
    for i, (h, name) in enumerate(plan):
        label = f"H{h}_{name}"
        _log(f"[{i + 1}/{len(plan)}] DiLoCo H={h} {name}: {2 * T} inner steps per worker")
        flags = [
            *common,
            "--inner-steps",
            str(h),
            "--rounds",
            str(2 * T // h),
            "--procs",
            "2",
            "--threads",
            "1",
        ]
        r = _train(work / label, [*flags, *CODECS[name]])
        to_bytes, to_steps = _to_target(r["evals"], target)
        runs[label] = {
            "H": h,
            "codec": name,
            "final_val_loss": r["summary"]["final_subset_val_loss"],
            "bytes_sent": r["summary"]["bytes_sent"],
            "reached": to_bytes is not None,
            "bytes_to_target": to_bytes,
            "steps_to_target": to_steps,
            "bytes_ratio": to_bytes / dp_bytes if to_bytes is not None else None,
            "curve": [(e["bytes_sent"], e["val_loss"]) for e in r["evals"]],
        }
        _log(
            f"  final {runs[label]['final_val_loss']:.4f}; "
            + (
                f"reached at step {to_steps}, bytes ratio {to_bytes / dp_bytes:.2e}"
                if to_bytes
                else "not reached"
            )
        )
    fp32 = runs[f"H{hs[0]}_fp32"]["final_val_loss"]
    gaps = {name: runs[f"H{hs[0]}_{name}"]["final_val_loss"] / fp32 - 1 for name in CODECS}
    reached = [r["bytes_ratio"] for r in runs.values() if r["reached"]]
    result = {
        "benchmark": "bytes_to_loss",
        "workers": args.workers,
        "dp_steps": T,
        "diloco_steps": 2 * T,
        "quick": args.quick,
        "dp_final_val_loss": target,
        "dp_bytes_sent": dp_bytes,
        "dp_curve": [(e["bytes_sent"], e["val_loss"]) for e in dp["evals"]],
        "runs": runs,
        "best_bytes_ratio": min(reached) if reached else None,
        "best_run": min((k for k, r in runs.items() if r["reached"]), key=lambda k: runs[k]["bytes_ratio"])
        if reached
        else None,
        "loss_gap": gaps,
        "fp4_ef_loss_gap": gaps["fp4_ef"],
        "duration_s": round(time.perf_counter() - t0, 1),
    }
    _plot(result)
    text = json.dumps(result, indent=2)
    print(text)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


def _plot(result: dict, path: Path = FIGURE) -> None:
    """Loss against bytes sent: data parallel in black, a colour per codec, a line style per H."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs, ys = zip(*[(b, v) for b, v in result["dp_curve"] if b > 0], strict=True)
    ax.plot(xs, ys, "k-", lw=2, label="data parallel")
    colours = {name: f"C{i}" for i, name in enumerate(CODECS)}
    hs = sorted({r["H"] for r in result["runs"].values()})
    styles = dict(zip(hs, ["-", "--", ":", "-."], strict=False))
    for r in result["runs"].values():
        pts = [(b, v) for b, v in r["curve"] if b > 0]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(
                xs, ys, styles[r["H"]], color=colours[r["codec"]], lw=1.2, label=f"H={r['H']} {r['codec']}"
            )
    ax.axhline(result["dp_final_val_loss"], color="k", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent by all workers")
    ax.set_ylabel("validation loss (eval subset)")
    ax.set_ylim(top=min(3.2, ax.get_ylim()[1]))
    ax.set_title(f"{result['workers']} workers: loss against bytes sent (dotted: data parallel's final loss)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    if not result["quick"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
