"""`diloco plan`'s answers past this machine (issue 34; docs/planning.md "Planning past this
machine"): 1B and 10B models (the presets `1b`, `10b`) at the Streaming DiLoCo paper's step times
(0.1 s and 0.8 s per inner step), on links of 100 Mbit/s, 1 Gbit/s and 10 Gbit/s, with 4, 16 and
64 workers, each worker's speed jittered by ±10% per job. Predictions, not measurements: their
calibration error is plan_vs_real.json's.

Methods (H = 100, 100 rounds, 50 simulated):
- `diloco`: sync DiLoCo under torchrun (`--runtime collective`: a ring all-reduce of fp32);
- `streaming_fp4`: Streaming DiLoCo under torchrun, fragments of 3 blocks (8 for 1B, 16 for
  10B), one overlapped step, fp4 with error feedback (an all-gather);
- `async`: the parameter server, async DN + DyLU (its defaults), each worker pulling θ in bf16
  and pushing fp4 with error feedback over its own link (the server's own link is not modelled:
  docs/server.md's capacity table says how many workers it sustains).

    python benchmarks/plan_tables.py    # ~1 minute; writes benchmarks/results/plan_tables.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from diloco.cli.configure import with_flags
from diloco.run.plan import Shapes, plan

MODELS = {"1b": (0.1, 8), "10b": (0.8, 16)}  # s per step, fragments of 3 blocks
LINKS = (100.0, 1000.0, 10000.0)
WORKERS = (4, 16, 64)
H, ROUNDS, JITTER = 100, 100, 0.1


def method_settings(method: str, fragments: int) -> tuple[dict, str]:
    if method == "diloco":
        return {"method": "diloco"}, "collective"
    if method == "streaming_fp4":
        return {
            "method": "diloco",
            "fragments": fragments,
            "overlap_steps": 1,
            "codec": "fp4",
            "error_feedback": True,
        }, "collective"
    return {"method": "async", "codec": "fp4", "error_feedback": True, "download_codec": "bf16"}, "server"


NAMES = {
    "diloco": "DiLoCo fp32 (torchrun)",
    "streaming_fp4": "Streaming fp4 (torchrun)",
    "async": "async DN + DyLU (server)",
}
BEGIN = "<!-- plan tables: benchmarks/plan_tables.py writes this block from results/plan_tables.json -->"
END = "<!-- end of plan tables -->"


def markdown(cells: list[dict]) -> str:
    """One table per model: each method and worker count a row; per link, the mean compute
    utilisation and the time per round; the link each worker needs for 95%; async's speedup
    over sync DiLoCo on the same star at equal local steps."""
    out = []
    for model in MODELS:
        links = " | ".join(f"{m / 1000:g} Gbit/s" if m >= 1000 else f"{m:g} Mbit/s" for m in LINKS)
        out += [
            f"**{model.upper()}** ({MODELS[model][0]} s a step): utilisation (s a round) per link",
            "",
            f"| method | workers | {links} | 95% needs (Gbit/s) | async ÷ sync speed |",
            "| --- | --- | " + " | ".join("---" for _ in LINKS) + " | --- | --- |",
        ]
        for method in NAMES:
            for k in WORKERS:
                row = [
                    c for c in cells if c["model"] == model and c["method"] == method and c["workers"] == k
                ]
                row.sort(key=lambda c: c["link_mbps"])
                per = " | ".join(f"{c['utilisation']:.2f} ({c['round_time_s']:.4g})" for c in row)
                speed = " / ".join(f"{c['speedup_vs_sync']:.2f}" for c in row) if method == "async" else ""
                need = row[0]["bandwidth_for_95pct_gbit_s"]
                out.append(f"| {NAMES[method]} | {k} | {per} | {need:.3g} | {speed} |")
        out.append("")
    return "\n".join(out).rstrip()


def write_docs(cells: list[dict], doc: Path) -> None:
    """Put the tables into `doc` between BEGIN and END (which must be there)."""
    text = doc.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:start] + "\n" + markdown(cells) + "\n" + text[end:])


def main() -> None:
    t0, shapes, cells = time.perf_counter(), Shapes(), []
    for model, (step_s, fragments) in MODELS.items():
        for method in ("diloco", "streaming_fp4", "async"):
            settings, runtime = method_settings(method, fragments)
            for k in WORKERS:
                for mbps in LINKS:
                    flags = {
                        "model.name": model,
                        "num_workers": k,
                        "inner_steps": H,
                        "rounds": ROUNDS,
                        "sim.speeds": (step_s,) * k,
                        "sim.speed_jitter": JITTER,
                        "sim.bandwidth_mbps": mbps,
                        **settings,
                    }
                    p = plan(with_flags({}, flags, where="plan_tables"), shapes=shapes, runtime=runtime)
                    need = [b for b in p["bandwidth_for_95pct_mbps"] if b is not None]
                    cell = {
                        "model": model,
                        "method": method,
                        "workers": k,
                        "link_mbps": mbps,
                        "utilisation": round(p["utilisation"]["mean"], 4),
                        "round_time_s": round(p["round_time_s"], 3),
                        "wall_time_h": round(p["wall_time_s"] / 3600, 4),
                        "sent_gb_per_worker": round(max(p["bytes_per_worker"]["sent"]) / 1e9, 3),
                        "bandwidth_for_95pct_gbit_s": round(max(need) / 1e3, 3) if need else None,
                    }
                    if method == "async":
                        cell["speedup_vs_sync"] = round(p["speedup_vs_sync"], 3)
                        cell["mean_staleness"] = round(p["mean_staleness"], 3)
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    result = {
        "benchmark": "plan_tables",
        "inner_steps": H,
        "rounds": ROUNDS,
        "speed_jitter": JITTER,
        "step_s": {m: s for m, (s, _) in MODELS.items()},
        "cells": cells,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out = Path(__file__).parent / "results" / "plan_tables.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    write_docs(cells, Path(__file__).parent.parent / "docs" / "planning.md")
    print(json.dumps({k: v for k, v in result.items() if k != "cells"}))


if __name__ == "__main__":
    main()
