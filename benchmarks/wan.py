"""Collective DiLoCo over a shaped link: 2 ranks in 2 network namespaces joined by one veth pair,
each direction limited by a token bucket (`tc qdisc ... tbf`), the rate chosen so that one fp32
exchange of the model takes about as long as H inner steps. Then the same run with
`--codec fp32` (plain DiLoCo), `--codec fp4 --error-feedback`, and streaming (fp4 with error
feedback, `--fragments P --overlap-steps TAU`), each reporting the compute utilisation the run
measured (summary.json's `compute_utilisation`: compute ÷ (compute + communication) of the
slowest rank, summed over rounds) and its final validation loss (`val_loss`, the whole split).

How, step by step:
1. two namespaces `diloco-wan-<pid>-0` and `-1`, veth ends `dw<pid>-0` (10.77.0.1/24) and
   `dw<pid>-1` (10.77.0.2/24), `lo` up in each; nothing outside them is touched, and they are
   deleted on every way out (finally, atexit, SIGTERM/SIGHUP/SIGINT; those of a SIGKILLed run
   by the next run);
2. calibration, link unshaped: fp32 for 2 rounds; `step_s` = its compute_s ÷ (2 H), measured
   with both ranks computing at once (one thread each), as they do in the timed runs;
   `model_bytes` = its parameter count × 4. Its utilisation (`calibration` in the JSON) is the
   ceiling on an unlimited link: comm_s there is the wait for the slower rank and the small
   collectives of every round;
3. `link_mbps` = model_bytes × 8 ÷ (H × step_s) ÷ 1e6 (or `--link-mbps`). A 2-rank all-reduce
   (gloo's ring: reduce-scatter then all-gather, each moving (n−1)/n of the buffer) sends ~1×
   the model each way at the same time; both veth ends are shaped, so one exchange takes about
   model_bytes × 8 ÷ rate: the link is full duplex, not shared by the two directions;
4. the shaping is checked: a TCP transfer of ~2 s of data each way between the namespaces
   (`measured_link_mbps`, the slower direction; payload bytes, so a few % under the rate for
   the TCP/IP headers);
5. each configuration: `ip netns exec NS python -m diloco train --runtime collective` for rank 0
   and rank 1 without torchrun (RANK, WORLD_SIZE=2, MASTER_ADDR = rank 0's veth address, ...).
   A flag the CLI refuses (exit 2) makes that row {"error": <its message>}.

tbf's settings: `burst` = max(rate ÷ 250, 32 kbit): a token bucket refilled by a timer of HZ
ticks must hold a tick's worth of bytes to reach its rate (250 is a common CONFIG_HZ; on a
1000 Hz kernel the bucket is 4× larger than needed, still < 0.3% of one fp32 exchange), and at
least a few MTU-sized packets. `latency` 100 ms: the longest a packet may wait in tbf's queue
(it sizes the queue; it adds no delay to an idle link: this kernel has no netem).

Gloo across namespaces: the hostname resolves to 127.0.0.1 here (and on most machines to a
loopback or a host address), which gloo would advertise to its peer; GLOO_SOCKET_IFNAME (and
TP_SOCKET_IFNAME) name each rank's veth so gloo binds and advertises that address instead.

Needs root, `ip` and `tc` (exits 2 otherwise). Prints one JSON object and saves it under
benchmarks/results/ (wan.json).

    python benchmarks/wan.py                         # nano, H=50, 6 rounds each: ~5 minutes on 2 cores
    python benchmarks/wan.py --quick                 # a tiny model, H=4, 2 rounds: ~20 s (a smoke test)
    python benchmarks/wan.py --link-mbps 8           # skip the calibration

tests/integration/test_wan.py checks the namespaces, the shaping and the cleanup (no training).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# --quick: the tests' tiny model (tests/conftest.py), small enough that a round takes ~0.1 s.
QUICK_TOML = "[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n"
QUICK_FLAGS = ["--seq-len", "32", "--batch-size", "4"]
QUEUE_MS = 100  # tbf's latency: the queue holds rate × 100 ms (+ burst)
MIN_BURST_BYTES = 4000  # 32 kbit
HZ = 250
CALIBRATION_ROUNDS = 2


def log(text: str) -> None:
    print(f"[wan] {text}", file=sys.stderr, flush=True)


def missing() -> str | None:
    """Why this machine cannot run the benchmark, in one sentence (None: it can)."""
    if os.geteuid() != 0:
        return "wan.py creates network namespaces and shapes them with tc: run it as root."
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"wan.py needs '{tool}' (iproute2) on PATH; install iproute2."
    return None


class LinkError(RuntimeError):
    """`ip` or `tc` refused: no namespaces, veth or tbf here."""


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise LinkError(f"'{' '.join(cmd)}' failed: {done.stderr.strip() or done.returncode}")


# ---------------------------------------------------------------------------------------------
# The link: two namespaces, one veth pair, tbf on both ends; every one made is deleted on exit.

_LIVE: list[Link] = []
_CHILDREN: list[subprocess.Popen] = []
_SEQ = [0]


def cleanup_all() -> None:
    """Kill the processes we started in the namespaces, then delete every live link."""
    for p in list(_CHILDREN):
        _kill(p)
    for link in list(_LIVE):
        link.close()


atexit.register(cleanup_all)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # its own session (start_new_session): only ours
        except ProcessLookupError:
            pass
        p.wait()
    if p in _CHILDREN:
        _CHILDREN.remove(p)


def sweep_stale() -> list[str]:
    """Delete the namespaces of wan.py processes that are gone (a SIGKILL skips every cleanup)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale = []
    for name in (line.split()[0] for line in out.splitlines() if line.startswith("diloco-wan-")):
        pid = name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            stale.append(name)
    return stale


def _on_signal(signum, frame) -> None:
    cleanup_all()
    sys.exit(128 + signum)


def install_signal_handlers() -> None:
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, _on_signal)


def _spawn(cmd: list[str], **kw) -> subprocess.Popen:
    p = subprocess.Popen(cmd, start_new_session=True, **kw)
    _CHILDREN.append(p)
    return p


class Link:
    """Namespaces `diloco-wan-<pid>-<2s>` and `-<2s+1>` (s: this process's link count) joined by
    veth ends `dw<pid>-<2s>`/`-<2s+1>` with addresses 10.77.<s>.1 and .2. The addresses exist only
    inside the two namespaces. `with Link(rate_mbps) as link:` deletes them whatever happens."""

    def __init__(self, rate_mbps: float | None = None):
        seq = _SEQ[0]
        _SEQ[0] += 1
        pid = os.getpid()
        self.ns = [f"diloco-wan-{pid}-{2 * seq + i}" for i in (0, 1)]
        self.dev = [f"dw{pid}-{2 * seq + i}" for i in (0, 1)]
        self.addr = [f"10.77.{seq % 256}.{i + 1}" for i in (0, 1)]
        self.rate_mbps: float | None = None
        self.burst_bytes: int | None = None
        self._open = False
        self._initial_rate = rate_mbps

    def open(self) -> Link:
        _LIVE.append(self)
        self._open = True
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for i in (0, 1):
                _sh("ip", "link", "set", self.dev[i], "netns", self.ns[i])
                _sh("ip", "-n", self.ns[i], "addr", "add", f"{self.addr[i]}/24", "dev", self.dev[i])
                _sh("ip", "-n", self.ns[i], "link", "set", self.dev[i], "up")
                _sh("ip", "-n", self.ns[i], "link", "set", "lo", "up")
            if self._initial_rate:
                self.shape(self._initial_rate)
        except BaseException:
            self.close()
            raise
        return self

    def shape(self, rate_mbps: float) -> None:
        """Limit both directions to rate_mbps (Mbit/s, 1e6 bits) with tbf (replaces any limit)."""
        bits = rate_mbps * 1e6
        self.burst_bytes = max(int(bits / HZ / 8), MIN_BURST_BYTES)
        for i in (0, 1):
            _sh(
                "tc", "-n", self.ns[i], "qdisc", "replace", "dev", self.dev[i], "root", "tbf",
                "rate", f"{int(bits)}bit", "burst", str(self.burst_bytes), "latency", f"{QUEUE_MS}ms",
            )  # fmt: skip
        self.rate_mbps = rate_mbps

    def unshape(self) -> None:
        for i in (0, 1):
            subprocess.run(
                ["tc", "-n", self.ns[i], "qdisc", "del", "dev", self.dev[i], "root"], capture_output=True
            )
        self.rate_mbps = self.burst_bytes = None

    def exec(self, side: int) -> list[str]:
        """The prefix that runs a command in namespace `side`."""
        return ["ip", "netns", "exec", self.ns[side]]

    def close(self) -> None:
        """Delete both namespaces (which deletes the veth pair); safe to call twice."""
        if not self._open:
            return
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # a veth whose namespace failed to be created is still in ours
        subprocess.run(["ip", "link", "del", self.dev[0]], capture_output=True)
        self._open = False
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> Link:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def measure_mbps(self, nbytes: int, *, sender: int = 1, port: int = 5201, timeout_s: float = 60) -> float:
        """Send nbytes over TCP from namespace `sender` to the other one; Mbit/s of payload from
        the first byte received to the last."""
        receiver = 1 - sender
        recv = _spawn(
            [*self.exec(receiver), sys.executable, "-c", _RECEIVER, self.addr[receiver], str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            if recv.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the receiver did not start: {recv.stderr.read().strip()}")
            send = _spawn(
                [
                    *self.exec(sender),
                    sys.executable,
                    "-c",
                    _SENDER,
                    self.addr[receiver],
                    str(port),
                    str(nbytes),
                ],
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                out, err = recv.communicate(timeout=timeout_s)
                send.wait(timeout=timeout_s)
            finally:
                _kill(send)
            got, seconds = json.loads(out)
            if got != nbytes:
                raise RuntimeError(f"received {got} of {nbytes} bytes: {err.strip()}")
            return got * 8 / seconds / 1e6
        finally:
            _kill(recv)


_RECEIVER = """
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = t1 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    t1 = time.perf_counter(); t0 = t0 or t1; n += len(b)
print(json.dumps([n, (t1 - t0) if n else 0.0]))
"""
_SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.sendall(b"\\0" * int(sys.argv[3])); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


# ---------------------------------------------------------------------------------------------
# One configuration: `diloco train --runtime collective`, rank r in namespace r.

CONFIGS = {
    "fp32": lambda P, tau: ["--codec", "fp32"],
    "fp4": lambda P, tau: ["--codec", "fp4", "--error-feedback"],
    "streaming": lambda P, tau: [
        "--codec",
        "fp4",
        "--error-feedback",
        "--fragments",
        str(P),
        "--overlap-steps",
        str(tau),
    ],  # fmt: skip
}


def run_config(link: Link, flags: list[str], *, run_dir: Path, port: int, timeout_s: float) -> dict:
    """Train with `flags` on both ranks; summary.json's numbers, or {"error": ...}."""
    procs, logs = [], []
    for rank in (0, 1):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")},
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": link.addr[0],
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": link.dev[rank],
            "TP_SOCKET_IFNAME": link.dev[rank],
        }
        cmd = [
            *link.exec(rank), sys.executable, "-m", "diloco", "train", "--runtime", "collective",
            "--workers", "2", "--threads", "1", "--no-progress", "--out", str(run_dir), *flags,
        ]  # fmt: skip
        logs.append(run_dir.parent / f"{run_dir.name}.rank{rank}.log")
        with open(logs[-1], "w") as f:
            procs.append(_spawn(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    t0 = time.perf_counter()
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.perf_counter()  # give its peer a few seconds to end by itself
            if (failed_at and time.perf_counter() - failed_at > 10) or time.perf_counter() - t0 > timeout_s:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill(p)
    wall_s = time.perf_counter() - t0
    codes = [p.returncode for p in procs]
    if any(codes):
        # the rank that failed by itself (its peer may only have been killed by us)
        rank = next((r for r, c in enumerate(codes) if c not in (0, -signal.SIGKILL)), None)
        how = f"exited {codes[rank]}" if rank is not None else f"timed out after {timeout_s:.0f} s"
        rank = rank or 0
        lines = [x for x in logs[rank].read_text(errors="replace").splitlines() if x.strip()]
        last = lines[-1] if lines else f"exit code {codes[rank]}"
        if codes[rank] == 2:  # a flag the CLI refuses (not there yet, or a bad value)
            return {"error": last}
        return {"error": f"rank {rank} {how}: {last}"}
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "compute_utilisation": s.get("compute_utilisation"),
        "val_loss": s["val_loss"],
        "compute_s": s.get("compute_s"),
        "comm_s": s.get("comm_s"),
        "bytes_sent_per_worker": s["bytes_sent_per_worker"],
        "params": s["params"],
        "rounds": s["outer_updates"],
        "wall_s": round(wall_s, 2),
    }


# ---------------------------------------------------------------------------------------------


def run_wan(
    *,
    inner_steps: int,
    rounds: int,
    quick: bool,
    link_mbps: float | None,
    fragments: int,
    overlap_steps: int,
    configs: list[str],
    root: Path,
    log=log,
) -> dict:
    t_start = time.perf_counter()
    base = ["--inner-steps", str(inner_steps)]
    if quick:
        toml = root / "quick.toml"
        toml.write_text(QUICK_TOML)
        base += ["--config", str(toml), *QUICK_FLAGS]
    ports = iter(range(29401, 29500))  # a fresh store port per run: no TIME_WAIT from the last one
    step_s = model_bytes = None

    def train(link: Link, name: str, flags: list[str], n_rounds: int) -> dict:
        # generous: a round is ~2 H steps at the calibrated rate, plus start-up and evals
        budget = 300 + 10 * n_rounds * inner_steps * (step_s or 1.0)
        # one evaluation, at the end: rank 0 evaluating between rounds would count as the other
        # rank's communication time (it waits for rank 0 in the next exchange)
        evals = ["--eval-every", str(n_rounds * inner_steps)]
        row = run_config(
            link,
            [*base, "--rounds", str(n_rounds), *evals, *flags],
            run_dir=root / name,
            port=next(ports),
            timeout_s=budget,
        )
        log(f"{name}: {row}")
        return row

    with Link() as link:
        log(f"namespaces {link.ns[0]} ({link.addr[0]}) and {link.ns[1]} ({link.addr[1]})")
        calibration = None
        if link_mbps is None:
            log(f"calibration: fp32, {CALIBRATION_ROUNDS} rounds of H={inner_steps}, link unshaped")
            calibration = train(
                link, "calibration", CONFIGS["fp32"](fragments, overlap_steps), CALIBRATION_ROUNDS
            )
            if "error" in calibration:
                raise RuntimeError(f"the calibration run failed: {calibration['error']}")
            step_s = calibration["compute_s"] / (CALIBRATION_ROUNDS * inner_steps)
            model_bytes = calibration["params"] * 4
            link_mbps = model_bytes * 8 / (inner_steps * step_s) / 1e6
            log(f"step {step_s * 1000:.1f} ms, model {model_bytes / 1e6:.3f} MB: link {link_mbps:.2f} Mbit/s")
        link.shape(link_mbps)
        burst_bytes = link.burst_bytes
        nbytes = max(1_000_000, int(link_mbps * 1e6 / 8 * 2))  # ~2 s each way
        each_way = [round(link.measure_mbps(nbytes, sender=s), 3) for s in (1, 0)]
        log(f"shaped {link_mbps:.2f} Mbit/s (burst {burst_bytes} B): measured {each_way} Mbit/s")
        rows = {}
        for name in configs:
            flags = CONFIGS[name](fragments, overlap_steps)
            log(f"{name}: {rounds} rounds of H={inner_steps}, {' '.join(flags)}")
            rows[name] = {"flags": flags, **train(link, name, flags, rounds)}
    fp32 = rows.get("fp32", {})
    if step_s is None and fp32.get("compute_s"):  # --link-mbps: the fp32 run's own step time
        step_s = fp32["compute_s"] / (rounds * inner_steps)
    if model_bytes is None:
        model_bytes = next((r["params"] * 4 for r in rows.values() if "params" in r), None)
    for row in rows.values():
        if row.get("comm_s") is not None:
            row["exchange_s"] = round(row["comm_s"] / rounds, 3)  # measured, per round
    result = {
        "benchmark": "wan",
        "model": "tiny (--quick)" if quick else "nano",
        "ranks": 2,
        "threads_per_rank": 1,
        "H": inner_steps,
        "rounds": rounds,
        "step_s": round(step_s, 5) if step_s else None,
        "model_bytes": model_bytes,
        "link_mbps": round(link_mbps, 3),
        "measured_link_mbps": min(each_way),
        "measured_link_mbps_each_way": each_way,
        "fp32_exchange_s_expected": round(model_bytes * 8 / (link_mbps * 1e6), 3) if model_bytes else None,
        "tbf": {"burst_bytes": burst_bytes, "latency_ms": QUEUE_MS},
        "fragments": fragments,
        "overlap_steps": overlap_steps,
    }
    for name, row in rows.items():
        result[f"utilisation_{name}"] = row.get("compute_utilisation")
        result[f"final_loss_{name}"] = row.get("val_loss")
    a, b = result.get("final_loss_streaming"), result.get("final_loss_fp32")
    result["streaming_loss_gap"] = round(a / b - 1, 5) if a is not None and b else None
    result["configs"] = rows
    if calibration is not None:
        result["calibration"] = calibration
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default: 50; --quick: 4)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per configuration (6; --quick: 2)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and run (a smoke test)")
    parser.add_argument(
        "--link-mbps", type=float, default=None, help="the link's rate; skips the calibration"
    )
    parser.add_argument(
        "--fragments",
        type=int,
        default=None,
        help="streaming: P fragments (default: 4; --quick: 2, its blocks)",
    )
    parser.add_argument(
        "--overlap-steps", type=int, default=None, help="streaming: tau (default: a tenth of H, at least 1)"
    )
    parser.add_argument("--configs", default="fp32,fp4,streaming", help="which rows, comma-separated")
    parser.add_argument("--out", default=str(RESULTS / "wan.json"))
    args = parser.parse_args()
    reason = missing()
    if reason:
        print(reason, file=sys.stderr)
        sys.exit(2)
    H = args.inner_steps or (4 if args.quick else 50)
    rounds = args.rounds or (2 if args.quick else 6)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r}; use some of {', '.join(CONFIGS)}")
    install_signal_handlers()
    for name in sweep_stale():
        log(f"deleted {name}, left by a wan.py that was killed")
    with tempfile.TemporaryDirectory(prefix="diloco-wan-") as tmp:
        try:
            result = run_wan(
                inner_steps=H,
                rounds=rounds,
                quick=args.quick,
                link_mbps=args.link_mbps,
                fragments=args.fragments or (2 if args.quick else 4),
                overlap_steps=args.overlap_steps or max(1, H // 10),
                configs=configs,
                root=Path(tmp),
            )
        except LinkError as e:
            print(f"wan.py cannot build the shaped link here: {e}", file=sys.stderr)
            sys.exit(2)
        except RuntimeError as e:
            print(f"wan.py: {e}", file=sys.stderr)
            sys.exit(1)
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
