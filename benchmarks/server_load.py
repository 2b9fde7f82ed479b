"""The parameter server under load and faults: `--workers` (32) `diloco worker` processes against
one async `diloco serve` on loopback (tiny model, short jobs), while a chaos loop kills random
workers with SIGKILL and starts new ones, and kills the server once with SIGKILL and restarts
it with `--resume` on the same port.

Every worker appends each acknowledged push to its own file (`diloco worker --acks`); at the end
the server's event log (events.jsonl, which a resume cuts back to the checkpoint and rewrites
from the write-ahead log) must hold every acknowledged push exactly once and have applied it
once. JSON: `workers`, `worker_kills`, `server_kills`, `pushes_acknowledged`, `pushes_applied`,
`duplicates_applied` (must be 0), `lost_acknowledged` (must be 0), `rejected` (by reason),
`push_latency_p50_s`/`push_latency_p99_s` (the workers' push round trips, acknowledged ones),
`server_peak_rss_mb` (the larger VmHWM of the server's two lives), `duration_s`, `ok`.

    python benchmarks/server_load.py                 # 32 workers, ~3 minutes on 2 cores
    python benchmarks/server_load.py --workers 8     # the size the test suite runs

tests/integration/test_server_load.py runs the 8-worker version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TINY = "[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _lines(path: Path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except OSError:
        return []


def run_load(
    *,
    workers: int = 32,
    rounds: int = 24,
    inner_steps: int = 4,
    worker_kills: int = 8,
    server_kills: int = 1,
    server_kill_at: float = 0.4,
    time_limit_s: float = 900.0,
    seed: int = 0,
    root: Path | None = None,
    log=print,
) -> dict:
    """Run the load test in `root` (a new temporary directory by default); returns the report.
    Progress is counted in acknowledged pushes against those expected (k × rounds: at least one
    per worker and round): the server is killed at `server_kill_at` of them, and each of the
    `worker_kills` workers at a random point from 10% to 90% (those the run does not reach do not
    happen)."""
    root = Path(tempfile.mkdtemp(prefix="diloco-load-")) if root is None else Path(root)
    run_dir, acks = root / "run", root / "acks"
    acks.mkdir(parents=True, exist_ok=True)
    (root / "tiny.toml").write_text(TINY)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "DILOCO_TOKEN": secrets.token_urlsafe(32),
    }
    port = _free_port()
    rng = random.Random(seed)
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log_name: str) -> subprocess.Popen:
        with open(root / log_name, "ab") as out:
            p = subprocess.Popen(
                [sys.executable, "-m", "diloco", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.append(p)
        return p

    serve_args = ["serve", "--port", str(port), "--http-port", "-1", "--no-progress"]
    settings = [
        "--config", str(root / "tiny.toml"), "--seq-len", "32", "--batch-size", "4", "--threads", "1",
        "--method", "async", "--workers", str(workers), "--inner-steps", str(inner_steps),
        "--rounds", str(rounds), "--eval-every", str(rounds * inner_steps), "--checkpoint-every", "2",
        "--worker-timeout-s", "10", "--seed", str(seed), "--out", str(run_dir),
    ]  # fmt: skip
    t0 = time.time()
    server = start([*serve_args, *settings], "server.log")
    lives = [server]
    generation = [0] * workers

    def start_worker(i: int) -> subprocess.Popen:
        generation[i] += 1
        ack = acks / f"w{i:02d}-{generation[i]}.jsonl"
        cmd = [
            "worker",
            "--server",
            f"127.0.0.1:{port}",
            "--threads",
            "1",
            "--retry-s",
            "60",
            "--acks",
            str(ack),
        ]
        return start(cmd, f"worker{i:02d}.log")

    def acknowledged() -> list[dict]:
        return [a for path in sorted(acks.glob("*.jsonl")) for a in _lines(path)]

    report: dict = {"workers": workers, "worker_kills": 0, "server_kills": 0}
    peak = 0.0
    try:
        live = {}
        for i in range(workers):  # staggered: 32 processes importing torch at once would thrash
            live[i] = start_worker(i)
            time.sleep(0.15)
        expected = workers * rounds
        kill_at = sorted(rng.uniform(0.1, 0.9) * expected for _ in range(worker_kills))
        while server.poll() is None:
            if time.time() - t0 > time_limit_s:
                raise TimeoutError(f"the run did not finish in {time_limit_s:.0f} s")
            peak = max(peak, _peak_rss_mb(server.pid))
            elapsed = time.time() - t0
            n = len(acknowledged())
            if kill_at and n >= kill_at[0]:
                kill_at.pop(0)
                i = rng.randrange(workers)
                live[i].send_signal(signal.SIGKILL)
                live[i].wait()
                report["worker_kills"] += 1
                log(f"killed worker {i} (pid {live[i].pid}) after {n} acknowledged pushes; starting another")
                live[i] = start_worker(i)
            if report["server_kills"] < server_kills and n >= server_kill_at * expected:
                peak = max(peak, _peak_rss_mb(server.pid))
                server.send_signal(signal.SIGKILL)
                server.wait()
                report["server_kills"] += 1
                log(f"killed the server at {elapsed:.1f} s after {n} acknowledged pushes; resuming it")
                time.sleep(1.0)
                server = start([*serve_args, "--resume", str(run_dir)], "server.log")
                lives.append(server)
            time.sleep(0.2)
        report["server_exit_code"] = server.returncode
        deadline = time.time() + 30  # the workers hear that the run is over
        for p in live.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        report["workers_exit_codes"] = sorted({p.returncode for p in live.values()})
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()

    acked = acknowledged()
    events = _lines(run_dir / "events.jsonl")
    pushed = [e["job"] for e in events if e["kind"] == "push"]
    applied = [e["job"] for e in events if e["kind"] == "apply"]
    rejected: dict[str, int] = {}
    for e in events:
        if e["kind"] == "reject":
            rejected[e["reason"]] = rejected.get(e["reason"], 0) + 1
    acked_jobs = {a["job"] for a in acked}
    latencies = sorted(a["push_s"] for a in acked)

    def quantile(q: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 4) if latencies else None

    report.update(
        {
            "inner_steps_per_job_max": inner_steps,
            "rounds": rounds,
            "server_finished": report.get("server_exit_code") == 0 and (run_dir / "summary.json").exists(),
            "pushes_acknowledged": len(acked_jobs),
            "pushes_logged": len(pushed),
            "pushes_applied": len(applied),
            "duplicates_applied": len(applied) - len(set(applied)),
            "lost_acknowledged": len(acked_jobs - (set(applied) & set(pushed))),
            "rejected": rejected,
            "push_latency_p50_s": round(statistics.median(latencies), 4) if latencies else None,
            "push_latency_p99_s": quantile(0.99),
            "server_peak_rss_mb": round(peak, 1),
            "duration_s": round(time.time() - t0, 1),
            "run_dir": str(run_dir),
        }
    )
    report["ok"] = (
        report["server_finished"] and report["duplicates_applied"] == 0 and report["lost_acknowledged"] == 0
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=24, help="budget: workers × rounds × H inner steps")
    parser.add_argument(
        "--inner-steps", type=int, default=4, help="H: the longest job (DyLU shortens slow ones)"
    )
    parser.add_argument("--worker-kills", type=int, default=8)
    parser.add_argument("--time-limit-s", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-replay", action="store_true", help="skip diloco replay of the run")
    parser.add_argument("--out", type=Path, default=RESULTS / "server_load.json")
    args = parser.parse_args()
    report = run_load(
        workers=args.workers,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        worker_kills=args.worker_kills,
        time_limit_s=args.time_limit_s,
        seed=args.seed,
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
    if not args.no_replay and report["server_finished"]:  # the applied updates, recomputed
        from diloco.runtime.server.replay import replay

        report["replay_bitwise_equal"] = replay(Path(report["run_dir"]), progress=False)["bitwise_equal"]
        report["ok"] = report["ok"] and report["replay_bitwise_equal"]
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
