"""Does the simulator use all cores? The same run with `--procs 2` and `--procs 1`, alternated,
in sync and in async mode; results compared bit for bit. Prints one JSON object and saves it
under benchmarks/results/.

    python benchmarks/sim_parallel.py        # ~6 minutes on 2 cores

tokens/s is the run's tokens over its training wall time (from summary.json: building the
workers, i.e. starting processes, is not counted; evaluations in the main process are).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file

from diloco.config import AsyncConfig, SimConfig, TrainConfig
from diloco.run.train import train

SPEEDS = (0.58, 0.75, 1.51, 3.33)


def _run(method: str, procs: int, out: Path, args) -> dict:
    cfg = TrainConfig(
        method=method,
        num_workers=4,
        inner_steps=args.inner_steps,
        rounds=args.rounds,
        out=str(out),
        sim=SimConfig(speeds=SPEEDS, procs=procs),
        async_=AsyncConfig(rule="dn"),
    )
    summary = train(cfg, progress=False)
    return {
        "tokens_per_s": summary["tokens"] / (summary["wall_time_s"] - summary["eval_time_s"]),
        "with_eval": summary["tokens"] / summary["wall_time_s"],
        "summary": summary,
        "params": load_file(str(out / "model.safetensors")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=1, help="alternations of procs 1 and 2 per mode")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    runs = args.out / "sim_parallel_runs"
    shutil.rmtree(runs, ignore_errors=True)
    result = {
        "benchmark": "sim_parallel",
        "num_workers": 4,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "target_ratio": 1.8,
    }
    for method in ("diloco", "async"):
        speed = {1: [], 2: []}
        whole = {1: [], 2: []}
        reference = None
        identical = True
        for rep in range(args.repeats):
            for procs in (1, 2) if rep % 2 == 0 else (2, 1):
                r = _run(method, procs, runs / f"{method}-p{procs}-r{rep}", args)
                speed[procs].append(r["tokens_per_s"])
                whole[procs].append(r["with_eval"])
                if reference is None:
                    reference = r
                else:
                    same = reference["params"].keys() == r["params"].keys() and all(
                        reference["params"][k].equal(r["params"][k]) for k in r["params"]
                    )
                    identical = (
                        identical and same and r["summary"]["val_loss"] == reference["summary"]["val_loss"]
                    )
                print(f"{method} procs={procs} {r['tokens_per_s']:.0f} tokens/s", flush=True)
        one, two = sum(speed[1]) / len(speed[1]), sum(speed[2]) / len(speed[2])
        prefix = "" if method == "diloco" else "async_"
        result.update(
            {
                f"{prefix}procs1_tokens_per_s": round(one, 1),
                f"{prefix}procs2_tokens_per_s": round(two, 1),
                f"{prefix}ratio": round(two / one, 3),
                f"{prefix}ratio_with_eval": round(sum(whole[2]) / sum(whole[1]), 3),
                f"{prefix}bit_identical": identical,
            }
        )
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_parallel.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
