"""The run's summary: summary.json's fields and the lines `diloco train` prints at the end.

    python -c "import json; from diloco.summary import format_summary as f; \
print(f(json.load(open('runs/diloco-k4-H50-s0/summary.json'))))"
"""

from __future__ import annotations

from typing import Any

from diloco.config import TrainConfig
from diloco.metrics import perplexity


def summarize(cfg: TrainConfig, run, val_loss: float, step: int) -> dict[str, Any]:
    """summary.json's fields, from the runtime interface (runtime/__init__.py) alone."""
    trainer = run.trainer
    side = trainer.side
    k = trainer.num_workers
    steps_total = side.total_steps
    # The busiest worker (workers may come and go, or run at different speeds): its steps, its
    # bytes, and what data parallel would have sent for those steps, a gradient each (with one
    # worker, nothing).
    busiest = max(range(k), key=lambda w: side.worker_steps[w])
    per_worker = max(side.bytes_sent)
    dp_per_worker = side.worker_steps[busiest] * side.param_bytes if k > 1 else 0
    sent = side.bytes_sent[busiest]  # what that worker sent, against what data parallel would have
    return {
        "run_dir": cfg.out,
        "method": cfg.method,
        "num_workers": k,
        "params": sum(p.numel() for p in side.params),
        "val_loss": val_loss,
        "val_ppl": perplexity(val_loss),
        "final_subset_val_loss": run.val_loss,
        "tokens": run.tokens,
        "inner_steps": steps_total,  # summed over workers; data parallel: a gradient per worker per step
        "inner_steps_per_worker": side.worker_steps[busiest],
        # each worker's shard: its training tokens and its outer_grad weight |D_i| / Σ|D_j|
        "shards": [
            {"tokens": len(s), "weight": w} for s, w in zip(run.data.shards, run.data.weights, strict=True)
        ],
        "outer_updates": side.version,
        "nonfinite_dropped": side.nonfinite_dropped,
        "bytes_sent": sum(side.bytes_sent),
        "bytes_received": sum(side.bytes_received),
        "bytes_sent_per_worker": per_worker,
        "dp_bytes_sent_per_worker": dp_per_worker,
        "dp_bytes_ratio": dp_per_worker / sent if sent and dp_per_worker else None,
        "target_loss": cfg.target_loss or None,
        "time_to_target_s": run.target["sim_time_s"] if run.target else None,
        "steps_to_target": run.target["inner_step"] if run.target else None,
        "wall_time_s": round(run.wall_time_s(), 3),
        "eval_time_s": round(run.eval_time_s, 3),
        "sim_time_s": trainer.sim_time_s,
        "runtime": cfg.runtime,
        **_utilisation(run.timing_total),
        **trainer.summary_extras(),
    }


def _utilisation(timing: dict[str, float]) -> dict[str, float]:
    """Measured compute and communication time of a real runtime (none in the simulator)."""
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
        + "   (whole validation split)",
        f"  tokens {s['tokens']:,}   inner steps {s['inner_steps']:,} "
        f"({s['inner_steps_per_worker']:,} per worker)   outer updates {s['outer_updates']}",
    ]
    sent = s["bytes_sent_per_worker"]
    if s["method"] == "dp" and sent:
        lines.append(f"  bytes sent per worker {sent / mb:.2f} MB (a gradient every step)")
    elif s["dp_bytes_ratio"] is not None:
        lines.append(
            f"  bytes sent per worker {sent / mb:.2f} MB: {s['dp_bytes_ratio']:.1f}x fewer than data "
            f"parallel ({s['dp_bytes_sent_per_worker'] / mb:.2f} MB) for the same inner steps"
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
