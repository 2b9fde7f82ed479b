"""The run's summary: summary.json's fields and the lines `diloco train` prints at the end.

    python -c "import json; from diloco.rundir.summary import format_summary as f; \
print(f(json.load(open('runs/diloco-k4-H50-s0/summary.json'))))"
"""

from __future__ import annotations

from typing import Any

from diloco.config import TrainConfig
from diloco.rundir.metrics import perplexity


def summarize(cfg: TrainConfig, run, val_loss: float, step: int) -> dict[str, Any]:
    """summary.json's fields, from the runtime interface (runtime/__init__.py) alone. Each figure
    has one definition in every runtime (docs/server.md, "The summary"): counts are what
    happened (inner steps whose outer_grad arrived, per worker and summed), and "per worker"
    means the mean over the run's k workers."""
    trainer = run.trainer
    side = trainer.side
    k = trainer.num_workers
    # data parallel would have sent a gradient for every one of those inner steps (one worker: nothing)
    dp_bytes = side.total_steps * side.param_bytes if k > 1 else 0
    sent_per_worker, dp_per_worker = round(sum(side.bytes_sent) / k), round(dp_bytes / k)
    extras = trainer.summary_extras()
    return {
        "run_dir": cfg.out,
        "method": cfg.method,
        "num_workers": k,
        "params": sum(p.numel() for p in side.params),
        "val_loss": val_loss,
        "val_ppl": perplexity(val_loss),
        "final_subset_val_loss": run.val_loss,
        "tokens": run.tokens,  # inner steps × tokens per inner step
        "inner_steps": side.total_steps,  # summed over workers; data parallel: a gradient per worker per step
        "inner_steps_per_worker": list(side.worker_steps),
        # each worker's shard: its training tokens and its outer_grad weight |D_i| / Σ|D_j|
        "shards": [
            {"tokens": len(s), "weight": w} for s, w in zip(run.data.shards, run.data.weights, strict=True)
        ],
        "outer_updates": side.version,
        "nonfinite_dropped": side.nonfinite_dropped,
        "bytes_sent": sum(side.bytes_sent),
        "bytes_received": sum(side.bytes_received),
        "bytes_sent_per_worker": sent_per_worker,
        "dp_bytes_sent_per_worker": dp_per_worker,
        "dp_bytes_ratio": dp_per_worker / sent_per_worker if sent_per_worker and dp_per_worker else None,
        "target_loss": cfg.target_loss or None,
        "time_to_target_s": run.target["sim_time_s"] if run.target else None,
        "steps_to_target": run.target["inner_step"] if run.target else None,
        "wall_time_s": round(run.wall_time_s(), 3),
        "eval_time_s": round(run.eval_time_s, 3),
        "sim_time_s": trainer.sim_time_s,
        "runtime": cfg.runtime,
        **({"eval_split": "tune"} if cfg.data.eval_on == "tune" else {}),  # val_loss scores the tuning split
        **_utilisation(_timing(run.timing_total, extras.get("workers"), k)),
        **extras,
    }


def _timing(measured: dict[str, float], rows: list[dict[str, Any]] | None, k: int) -> dict[str, float]:
    """A worker's mean compute and other seconds in the training part of the run, one definition
    for every runtime: sync rounds as they measured them (torchrun and the server alike: the
    workers' mean compute in a round, and the rest of the round's wall time, summed over rounds);
    without rounds (the async server) from its per-worker rows: computing, and the time from a
    worker's first job handed out to its last push. Start-up and the final evaluation count in
    neither."""
    if measured["compute_s"] + measured["comm_s"] > 0 or not rows:
        return measured
    compute_s = sum(r["compute_s"] for r in rows)
    return {"compute_s": compute_s / k, "comm_s": (sum(r.get("train_s", 0.0) for r in rows) - compute_s) / k}


def _utilisation(timing: dict[str, float]) -> dict[str, float]:
    """A worker's mean compute and other (communicating, waiting) seconds, and the share computing,
    in a real runtime (none in the simulator)."""
    total = timing["compute_s"] + timing["comm_s"]
    if not total:
        return {}
    return {
        "compute_s": round(timing["compute_s"], 3),
        "comm_s": round(timing["comm_s"], 3),
        "compute_utilisation": round(timing["compute_s"] / total, 4),
    }


def format_summary(s: dict[str, Any]) -> str:
    mb = 1e6
    lines = [
        f"done in {s['wall_time_s']:.1f} s"
        + (f" ({s['sim_time_s']:.1f} s simulated)" if s["sim_time_s"] is not None else "")
        + (f", compute utilisation {s['compute_utilisation']:.1%}" if "compute_utilisation" in s else "")
        + f": {s['run_dir']}",
        f"  val_loss {s['val_loss']:.4f}   val_ppl "
        + (f"{s['val_ppl']:.3f}" if s["val_ppl"] is not None else "overflow")
        + ("   (whole tuning split)" if s.get("eval_split") == "tune" else "   (whole validation split)"),
        f"  tokens {s['tokens']:,}   inner steps {s['inner_steps']:,} "
        f"({_each(s['inner_steps_per_worker'])} per worker)   outer updates {s['outer_updates']}",
    ]
    sent = s["bytes_sent_per_worker"]
    if s["method"] == "dp" and sent:
        lines.append(f"  bytes sent per worker {sent / mb:.2f} MB (a gradient every step)")
    elif s["dp_bytes_ratio"] is not None:
        lines.append(
            f"  bytes sent per worker {sent / mb:.2f} MB (mean of {s['num_workers']}): "
            f"{s['dp_bytes_ratio']:.1f}x fewer than data parallel "
            f"({s['dp_bytes_sent_per_worker'] / mb:.2f} MB) for the same inner steps"
        )
    else:
        lines.append(
            f"  bytes sent per worker {sent / mb:.2f} MB (one worker: data parallel would send nothing)"
        )
    if s["target_loss"] is not None:
        reached = s["time_to_target_s"]
        lines.append(
            f"  target val_loss {s['target_loss']}: "
            + (
                f"reached at {reached:.1f} s simulated (step {s['steps_to_target']})"
                if reached is not None
                else "not reached"
            )
        )
    return "\n".join(lines)


def _each(counts: list[int] | int) -> str:
    """Per-worker counts: one number if they are equal, each (a few workers) or the range. (A
    summary.json written before issue 29 holds one number, the busiest worker's.)"""
    counts = [counts] if isinstance(counts, int) else counts
    if min(counts) == max(counts):
        return f"{counts[0]:,}"
    if len(counts) <= 8:
        return "/".join(f"{n:,}" for n in counts)
    return f"{min(counts):,}–{max(counts):,}"
