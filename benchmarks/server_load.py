"""The parameter server under load and faults: `--workers` (32) `diloco worker` processes against
one async `diloco serve` on loopback (tiny model, short jobs), while a chaos loop kills random
workers with SIGKILL and starts new ones, and kills the server once with SIGKILL and restarts
it with `--resume` on the same port.

Every worker appends each acknowledged push to its own file (`diloco worker --acks`); at the end
the server's event log (events.jsonl, which a resume cuts back to the checkpoint and rewrites
from the write-ahead log) must hold every acknowledged push exactly once and have applied it
once. The server is killed in the second half of an interval between two checkpoints, so that
its resume has acknowledged pushes to replay from the write-ahead log (`wal_events_replayed`),
not only the checkpoint. JSON: `workers`, `worker_kills`, `server_kills`, `pushes_acknowledged`,
`pushes_applied`, `duplicates_applied` (must be 0), `lost_acknowledged` (must be 0), `rejected`
(by reason), `push_latency_p50_s`/`push_latency_p99_s` (the workers' push round trips,
acknowledged ones; the p99 includes the pushes that waited out the server's restart),
`server_peak_rss_mb` (the largest VmHWM of the server's lives), `duration_s`, `ok`.

    python benchmarks/server_load.py                 # 32 workers, ~2 minutes on 2 cores
    python benchmarks/server_load.py --workers 8     # the size the test suite runs

tests/integration/test_server_load.py runs the 8-worker version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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


def _newest_checkpoint(run_dir: Path) -> int:
    """The round of the newest checkpoint directory (-1: none yet)."""
    names = (p.name for p in (run_dir / "checkpoints").glob("round-*"))
    return max((int(m[1]) for m in map(re.compile(r"round-(\d+)$").match, names) if m), default=-1)


class _StepsPushed:
    """The inner steps in the server's accepted pushes so far: its events.jsonl, read as it grows.
    A resume cuts the file back to its checkpoint: `reset` once the new server listens."""

    def __init__(self, path: Path):
        self.path, self.offset, self.steps = path, 0, 0

    def reset(self) -> None:
        self.offset = self.steps = 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # cut back under us
                    self.reset()
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.steps
        whole = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next call
        self.offset += len(whole)
        for line in whole.splitlines():
            event = json.loads(line)
            if event["kind"] == "push":
                self.steps += event["steps"]
        return self.steps


def _listening_pid(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / "server.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


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
    server_kill_at: float = 0.25,
    checkpoint_every: int = 2,
    time_limit_s: float = 900.0,
    seed: int = 0,
    root: Path | None = None,
    log=print,
) -> dict:
    """Run the load test in `root` (a new temporary directory by default); returns the report.
    Progress is counted in the inner steps of the server's accepted pushes (events.jsonl) against
    the budget (k × rounds × H): each of the `worker_kills` workers is killed at a random point
    from 10% to 70% (later, its replacement might start after the run is over), and the server,
    from `server_kill_at` on, in the second half of an interval between two checkpoints (round-r
    is taken at r × k × H steps), once more after each later checkpoint for `server_kills` > 1
    (kills the run does not reach do not happen)."""
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
        "--rounds", str(rounds), "--eval-every", str(rounds * inner_steps),
        "--checkpoint-every", str(checkpoint_every), "--worker-timeout-s", "10", "--seed", str(seed),
        "--out", str(run_dir),
    ]  # fmt: skip
    t0 = time.time()
    server = start([*serve_args, *settings], "server.log")
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
        budget = workers * rounds * inner_steps
        kill_at = sorted(rng.uniform(0.1, 0.7) * budget for _ in range(worker_kills))
        per_round = workers * inner_steps  # checkpoint round-r is taken once r × k × H steps are in
        killed_after = -1
        progress, resuming, steps = _StepsPushed(run_dir / "events.jsonl"), False, 0
        while server.poll() is None:
            if time.time() - t0 > time_limit_s:
                raise TimeoutError(f"the run did not finish in {time_limit_s:.0f} s")
            peak = max(peak, _peak_rss_mb(server.pid))
            elapsed = time.time() - t0
            if resuming and _listening_pid(run_dir) == server.pid:  # events.jsonl was cut back
                progress.reset()
                resuming = False
            if not resuming:  # (until the new server has cut events.jsonl back, it is not read)
                steps = progress()
            checkpoint = _newest_checkpoint(run_dir)
            since = steps - checkpoint * per_round  # steps pushed since the newest checkpoint
            if kill_at and steps >= kill_at[0]:
                kill_at.pop(0)
                i = rng.randrange(workers)
                live[i].send_signal(signal.SIGKILL)
                live[i].wait()
                report["worker_kills"] += 1
                log(f"killed worker {i} (pid {live[i].pid}) at {steps / budget:.0%} of the budget; restarted")
                live[i] = start_worker(i)
            if (
                report["server_kills"] < server_kills
                and steps >= server_kill_at * budget
                and checkpoint > killed_after  # a checkpoint since the last kill (if any), and the
                and per_round * checkpoint_every / 2 <= since < per_round * checkpoint_every  # middle
            ):  # of the interval to the next one: the write-ahead log holds pushes to replay
                killed_after = checkpoint
                peak = max(peak, _peak_rss_mb(server.pid))
                server.send_signal(signal.SIGKILL)
                server.wait()
                report["server_kills"] += 1
                n = len(acknowledged())
                report.setdefault("acknowledged_at_server_kills", []).append(n)
                log(
                    f"killed the server at {elapsed:.1f} s, {steps / budget:.0%} of the budget, "
                    f"{since} steps after checkpoint round-{checkpoint:06d}, "
                    f"{n} pushes acknowledged; resuming it"
                )
                time.sleep(1.0)
                server = start([*serve_args, "--resume", str(run_dir)], "server.log")
                resuming = True
            time.sleep(0.05)  # at 2 s for 8 workers' whole run, a checkpoint interval is ~0.5 s
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
    try:  # what each resume replayed after its checkpoint (the server says so in one line)
        text = (root / "server.log").read_text()
        replayed = re.findall(r"replaying (\d+) events of the write-ahead log", text)
    except OSError:
        replayed = []
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
            "wal_events_replayed": [int(x) for x in replayed],
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
    parser.add_argument(
        "--rounds", "--budget", type=int, default=24, help="budget: workers × rounds × H inner steps"
    )
    parser.add_argument(
        "--inner-steps", type=int, default=4, help="H: the longest job (DyLU shortens slow ones)"
    )
    parser.add_argument("--worker-kills", type=int, default=8)
    parser.add_argument("--server-kills", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=2, help="rounds between checkpoints")
    parser.add_argument("--time-limit-s", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-replay", action="store_true", help="skip diloco replay of the run")
    parser.add_argument("--out", type=Path, default=RESULTS / "server_load.json")
    args = parser.parse_args()
    # `timeout` and the like send SIGTERM: end through run_load's finally, which kills the children
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    report = run_load(
        workers=args.workers,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        worker_kills=args.worker_kills,
        server_kills=args.server_kills,
        checkpoint_every=args.checkpoint_every,
        time_limit_s=args.time_limit_s,
        seed=args.seed,
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
    if not args.no_replay and report["server_finished"]:  # the applied updates, recomputed
        from diloco.run.replay import replay

        report["replay_bitwise_equal"] = replay(Path(report["run_dir"]), progress=False)["bitwise_equal"]
        report["ok"] = report["ok"] and report["replay_bitwise_equal"]
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
