"""A parameter server worker that is a torchrun group (run/group.py) against the same ranks under
plain torchrun (the collective runtime), on loopback.

Both run sync DiLoCo with one worker of 2 ranks (data parallel inside it over gloo, one intra-op
thread per rank) on the nano model, H inner steps × R rounds, the same seed:
(a) `diloco serve --workers 1 --procs-per-worker 2` and `torchrun --nproc-per-node 2 -m diloco
    worker` (the leader downloads θ, broadcasts it, the ranks train, the leader pushes);
(b) `torchrun --nproc-per-node 2 -m diloco train --runtime collective --workers 1
    --procs-per-worker 2`.
They alternate, (a) then (b), `--repeats` times. Reported per run: `tokens_per_s`, summary.json's
tokens ÷ the training part's wall time (its `compute_s` + `comm_s`, measured the same way in both
runtimes: docs/server.md, "The summary"), and the whole command's wall time; then
`group_vs_torchrun_tokens_per_s_ratio` = the median of (a) ÷ the median of (b) (target ≥ 0.95)
and whether the two computed the same global parameters (`bitwise_equal`: they should).

    python benchmarks/server_groups.py               # ~5 minutes on 2 cores, the machine to itself
    python benchmarks/server_groups.py --quick       # a tiny model: a smoke test (not saved)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
RANKS = 2
TINY = "[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n"


def _env(token: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DILOCO_TOKEN": token}


def _torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(RANKS),
        *args,
    ]


def _row(run_dir: Path, wall_s: float) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    train_s = s["compute_s"] + s["comm_s"]
    return {
        "tokens": s["tokens"],
        "train_s": round(train_s, 3),
        "tokens_per_s": round(s["tokens"] / train_s, 1),
        "compute_utilisation": s["compute_utilisation"],
        "wall_s": round(wall_s, 2),
        "val_loss": s["val_loss"],
    }


def run_server(flags: list[str], out: Path) -> dict:
    """(a): a server and one group worker of RANKS ranks."""
    env = _env(secrets.token_urlsafe(24))
    t0 = time.perf_counter()
    srv = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diloco",
            "serve",
            "--port",
            "0",
            "--http-port",
            "-1",
            *flags,
            "--out",
            str(out),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not (out / "server.json").is_file():
        if srv.poll() is not None:
            raise RuntimeError(f"diloco serve exited {srv.returncode}: {srv.stderr.read()[-2000:]}")
        time.sleep(0.05)
    address = json.loads((out / "server.json").read_text())["address"]
    group = subprocess.run(
        _torchrun("-m", "diloco", "worker", "--server", address, "--threads", "1"),
        env=env,
        capture_output=True,
        text=True,
    )
    _, err = srv.communicate(timeout=600)
    if srv.returncode or group.returncode:
        raise RuntimeError(
            f"server {srv.returncode}, group {group.returncode}: {(err + group.stderr)[-3000:]}"
        )
    return _row(out, time.perf_counter() - t0)


def run_torchrun(flags: list[str], out: Path) -> dict:
    """(b): the same ranks under plain torchrun."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        _torchrun("-m", "diloco", "train", "--runtime", "collective", *flags, "--out", str(out)),
        env=_env(""),
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"torchrun exited {proc.returncode}: {proc.stderr[-3000:]}")
    return _row(out, time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default 50; --quick 8)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 4; --quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke test, not saved")
    parser.add_argument(
        "--out", default=None, help="the JSON (default benchmarks/results/server_groups.json)"
    )
    args = parser.parse_args()
    H = args.inner_steps or (8 if args.quick else 50)
    rounds, repeats = args.rounds or (2 if args.quick else 4), args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="diloco-groups-") as tmp:
        root = Path(tmp)
        model = ["--model", "nano"]
        if args.quick:
            (root / "tiny.toml").write_text(TINY)
            model = ["--config", str(root / "tiny.toml"), "--seq-len", "32", "--batch-size", "4"]
        flags = [*model, "--workers", "1", "--procs-per-worker", str(RANKS), "--inner-steps", str(H)]
        flags += ["--rounds", str(rounds), "--eval-every", str(rounds * H), "--threads", "1", "--no-progress"]
        rows: dict[str, list[dict]] = {"server_group": [], "torchrun": []}
        equal = True
        for i in range(repeats):
            a = run_server(flags, root / f"server{i}")
            b = run_torchrun(flags, root / f"torchrun{i}")
            rows["server_group"].append(a)
            rows["torchrun"].append(b)
            same = (root / f"server{i}" / "model.safetensors").read_bytes() == (
                root / f"torchrun{i}" / "model.safetensors"
            ).read_bytes()
            equal = equal and same
            print(
                f"[groups] {i}: server group {a['tokens_per_s']} tok/s, torchrun {b['tokens_per_s']} tok/s",
                file=sys.stderr,
            )
    median = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in rows.items()}
    result = {
        "benchmark": "server_groups",
        "model": "tiny (--quick)" if args.quick else "nano",
        "ranks_per_worker": RANKS,
        "workers": 1,
        "threads_per_rank": 1,
        "H": H,
        "rounds": rounds,
        "repeats": repeats,
        "server_group_tokens_per_s": median["server_group"],
        "torchrun_tokens_per_s": median["torchrun"],
        "group_vs_torchrun_tokens_per_s_ratio": round(median["server_group"] / median["torchrun"], 4),
        "bitwise_equal": equal,
        "runs": rows,
    }
    print(json.dumps(result, indent=2))
    out = args.out or (None if args.quick else str(RESULTS / "server_groups.json"))
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"[groups] saved {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
