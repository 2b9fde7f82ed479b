"""DiLoCo over shaped links: the collective runtime (2 ranks in 2 network namespaces joined by one
veth pair) and the parameter server (a hub namespace for `diloco serve`, one namespace per
`diloco worker`, each joined to the hub by its own veth pair), every veth end limited by a token
bucket (`tc qdisc ... tbf`) to one rate, chosen so that one fp32 exchange of the model takes
about as long as H inner steps. Rows (`--configs`, comma-separated; collective rows run first):

- `fp32` (plain DiLoCo), `fp4` (`--codec fp4 --error-feedback`), `streaming` (fp4 with error
  feedback, `--fragments P --overlap-steps TAU`), `streaming_fp32` (the same in fp32, which
  sends as many bytes as `fp32`, spread over the round: the link's own limit):
  `diloco train --runtime collective`;
  `utilisation_<row>` is summary.json's `compute_utilisation`: the workers' mean compute ÷ the
  round's wall time, summed over rounds (docs/server.md, "The summary": one definition for
  every runtime);
- `server_fp32` (`--codec fp32`), `server_fp4` (`--codec fp4 --error-feedback
  --download-codec bf16`), and `server_streaming_fp32` / `server_streaming_fp4` (the same with
  `--fragments P --overlap-steps TAU`: Streaming DiLoCo through the server, docs/server.md):
  `diloco serve --method diloco --workers 2` and two `diloco worker`s;
  `utilisation_<row>` is summary.json's `compute_utilisation`, measured as in the collective
  rows (the sync server's rounds: the pushes' mean compute ÷ the round's wall time, from θ
  handed out to the outer step; no start-up, no final evaluation); the row also has each
  worker's own share and the bytes each worker sent and received, payload and wire.

Each row reports its final validation loss (`final_loss_<row>`: `val_loss`, the whole split,
evaluated once at the end: `--eval-every` R × H).

How, step by step:
1. the collective link: namespaces `diloco-wan-<pid>-0` and `-1`, veth ends `dw<pid>-0`
   (10.77.0.1/24) and `dw<pid>-1` (10.77.0.2/24), `lo` up in each; nothing outside them is
   touched (the veths are made inside them), and they are deleted on every way out (finally,
   atexit, SIGTERM/SIGHUP/SIGINT; those of a SIGKILLed run by the next run);
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
5. each collective row: `ip netns exec NS python -m diloco train --runtime collective` for rank
   0 and rank 1 without torchrun (RANK, WORLD_SIZE=2, MASTER_ADDR = rank 0's veth address, ...);
6. the star, for the server rows, at the same rate: a hub namespace and two worker namespaces,
   worker w joined to the hub by its own pair (a /24 each, 10.77.<s>.1 at the hub, .2 at the
   worker), both ends shaped, each worker routing through its pair, so it reaches the server's
   address (the hub end of the first pair) over its own link: the workers share no bandwidth,
   as machines on separate WAN links would not. Checked like the link (`measured_star_mbps`:
   worker 1 pushing to the server's address, the hub sending to worker 2);
7. each server row: `diloco serve ... --host <hub address> --http-port -1 --checkpoint-every R`
   in the hub; once it has written RUN_DIR/server.json, `diloco worker --server ADDRESS
   --threads 1` in each worker namespace; DILOCO_TOKEN (random) in all their environments. A
   sync round moves the model twice over each worker's link, one after the other: the download
   of θ (fp32 or bf16) and the push of the outer_grad, so an fp32 round costs ~2 H steps of
   communication where the all-reduce, sending both ways at once, costs ~1 H.
A flag the CLI refuses (exit 2) makes that row {"error": <its message>}, as does any other
failure ({"error": "<rank, server or worker> exited N: <its last line>"}).

tbf's settings: `burst` = max(rate ÷ 250, 32 kbit): a token bucket refilled by a timer of HZ
ticks must hold a tick's worth of bytes to reach its rate (250 is a common CONFIG_HZ; on a
1000 Hz kernel the bucket is 4× larger than needed, still < 0.3% of one fp32 exchange), and at
least a few MTU-sized packets. `latency` 100 ms: the longest a packet may wait in tbf's queue
(it sizes the queue; it adds no delay to an idle link: this kernel has no netem).

Gloo across namespaces: the hostname resolves to 127.0.0.1 here (and on most machines to a
loopback or a host address), which gloo would advertise to its peer; GLOO_SOCKET_IFNAME (and
TP_SOCKET_IFNAME) name each rank's veth so gloo binds and advertises that address instead.
gRPC: proxy variables are dropped from the server's and workers' environments (a proxy outside
the namespaces cannot be reached from them).

Needs root, `ip` and `tc` (exits 2 otherwise). Prints one JSON object; a full run also saves
it as benchmarks/results/wan.json (`--out FILE` elsewhere; a --quick run saves nothing unless
given --out).

    python benchmarks/wan.py                    # nano, H=50, 6 rounds per row (see below)
    python benchmarks/wan.py --quick            # a tiny model, H=4, 2 rounds: ~1.5 min (a smoke test)
    python benchmarks/wan.py --link-mbps 8      # skip the calibration
    python benchmarks/wan.py --configs fp32,server_fp32    # some rows only

A full run on 2 cores: ~5 minutes for the calibration and the collective rows; the server rows
(3 H steps a round at the calibrated rate, where the collective fp32 takes 2) add about as much
again (estimated, not timed).

tests/integration/test_wan.py checks the namespaces, the star, the shaping and the cleanup (no
training).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

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
# The links: a hub namespace and one namespace per worker, each worker joined to the hub by its
# own veth pair, tbf on both ends of every pair (`Star`); `Link` is the star with one worker, two
# namespaces and one pair. Every one made is deleted on exit.

_LIVE: list[Star] = []
_CHILDREN: list[subprocess.Popen] = []
_SEQ = {"ns": 0, "dev": 0, "subnet": 0}  # this process's namespaces, veth ends and /24s so far


def _take(kind: str, n: int) -> range:
    start = _SEQ[kind]
    _SEQ[kind] += n
    return range(start, start + n)


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


class Pair(NamedTuple):
    """One veth pair: side 0 in the hub namespace, side 1 in a worker's; addresses 10.77.<s>.1
    (hub) and .2 (worker)."""

    ns: tuple[str, str]
    dev: tuple[str, str]
    addr: tuple[str, str]


class Star:
    """A hub namespace `ns[0]` and worker namespaces `ns[1..n]` (`diloco-wan-<pid>-<i>`, i counting
    this process's namespaces), worker w joined to the hub by `pairs[w-1]`: veth ends
    `dw<pid>-<j>` (j counting its veth ends), hub side 10.77.<s>.1, worker side 10.77.<s>.2 (s
    counting its pairs, a /24 each). Each worker namespace routes everything else through its
    pair, so every worker reaches `hub_addr` (the hub side of the first pair, where a server
    listens) over its own link. The hub does not forward between workers. `rate_mbps` shapes
    both ends of every pair alike. The addresses exist only inside the namespaces, which are
    created empty (the veths are made in them: nothing outside is touched).
    `with Star(2, rate_mbps) as star:` deletes them whatever happens."""

    def __init__(self, workers: int = 2, rate_mbps: float | None = None):
        if workers < 1:
            raise ValueError("a star needs at least one worker")
        pid = os.getpid()
        self.ns = [f"diloco-wan-{pid}-{i}" for i in _take("ns", workers + 1)]
        devs = [f"dw{pid}-{j}" for j in _take("dev", 2 * workers)]
        self.pairs = [
            Pair(
                ns=(self.ns[0], self.ns[w + 1]),
                dev=(devs[2 * w], devs[2 * w + 1]),
                addr=(f"10.77.{s % 256}.1", f"10.77.{s % 256}.2"),
            )
            for w, s in enumerate(_take("subnet", workers))
        ]
        self.hub_addr = self.pairs[0].addr[0]
        self.rate_mbps: float | None = None
        self.burst_bytes: int | None = None
        self._open = False
        self._initial_rate = rate_mbps

    @property
    def workers(self) -> int:
        return len(self.pairs)

    def open(self) -> Star:
        _LIVE.append(self)
        self._open = True
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            for p in self.pairs:
                _sh("ip", "-n", p.ns[0], "link", "add", p.dev[0], "type", "veth", "peer", "name", p.dev[1],
                    "netns", p.ns[1])  # fmt: skip
                for i in (0, 1):
                    _sh("ip", "-n", p.ns[i], "addr", "add", f"{p.addr[i]}/24", "dev", p.dev[i])
                    _sh("ip", "-n", p.ns[i], "link", "set", p.dev[i], "up")
                _sh("ip", "-n", p.ns[1], "route", "add", "default", "via", p.addr[0])
            if self._initial_rate:
                self.shape(self._initial_rate)
        except BaseException:
            self.close()
            raise
        return self

    def _ends(self):
        return [(p.ns[i], p.dev[i]) for p in self.pairs for i in (0, 1)]

    def shape(self, rate_mbps: float) -> None:
        """Limit both directions of every pair to rate_mbps (Mbit/s, 1e6 bits) with tbf (replaces
        any limit)."""
        bits = rate_mbps * 1e6
        self.burst_bytes = max(int(bits / HZ / 8), MIN_BURST_BYTES)
        for ns, dev in self._ends():
            _sh(
                "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{int(bits)}bit", "burst", str(self.burst_bytes), "latency", f"{QUEUE_MS}ms",
            )  # fmt: skip
        self.rate_mbps = rate_mbps

    def unshape(self) -> None:
        for ns, dev in self._ends():
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        self.rate_mbps = self.burst_bytes = None

    def exec(self, side: int) -> list[str]:
        """The prefix that runs a command in namespace `side` (0: the hub, w: worker w)."""
        return ["ip", "netns", "exec", self.ns[side]]

    def close(self) -> None:
        """Delete every namespace (which deletes the veth pairs); safe to call twice."""
        if not self._open:
            return
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._open = False
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> Star:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def measure_mbps(
        self,
        nbytes: int,
        *,
        sender: int = 1,
        worker: int = 1,
        to: str | None = None,
        port: int = 5201,
        timeout_s: float = 60,
    ) -> float:
        """Send nbytes over TCP between the hub and worker namespace `worker`, from the worker
        (sender=1) or from the hub (sender=0), to the other's end of their pair (or to the
        receiver's address `to`, e.g. `hub_addr`); Mbit/s of payload from the first byte
        received to the last."""
        ns = (0, worker)
        receiver = 1 - sender
        dst = to or self.pairs[worker - 1].addr[receiver]
        recv = _spawn(
            [*self.exec(ns[receiver]), sys.executable, "-c", _RECEIVER, dst, str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            if recv.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the receiver did not start: {recv.stderr.read().strip()}")
            send = _spawn(
                [*self.exec(ns[sender]), sys.executable, "-c", _SENDER, dst, str(port), str(nbytes)],
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


class Link(Star):
    """The star with one worker: namespaces `ns[0]` and `ns[1]` joined by one veth pair, ends
    `dev[0]`/`dev[1]` with addresses `addr[0]` (10.77.<s>.1) and `addr[1]` (.2).
    `with Link(rate_mbps) as link:` deletes them whatever happens."""

    def __init__(self, rate_mbps: float | None = None):
        super().__init__(1, rate_mbps)
        self.dev = list(self.pairs[0].dev)
        self.addr = list(self.pairs[0].addr)


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
# One configuration: `diloco train --runtime collective`, rank r in namespace r of a Link; or
# `diloco serve` in the hub of a Star and `diloco worker` w in its namespace w.

CONFIGS = {
    "fp32": lambda P, tau: ["--codec", "fp32"],
    "fp4": lambda P, tau: ["--codec", "fp4", "--error-feedback"],
    "streaming_fp32": lambda P, tau: ["--codec", "fp32", "--fragments", str(P), "--overlap-steps", str(tau)],
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
SERVER_CONFIGS = {
    "server_fp32": lambda P, tau: ["--codec", "fp32"],
    "server_fp4": lambda P, tau: ["--codec", "fp4", "--error-feedback", "--download-codec", "bf16"],
    "server_streaming_fp32": lambda P, tau: [
        "--codec",
        "fp32",
        "--fragments",
        str(P),
        "--overlap-steps",
        str(tau),
    ],
    "server_streaming_fp4": lambda P, tau: [
        "--codec",
        "fp4",
        "--error-feedback",
        "--download-codec",
        "bf16",
        "--fragments",
        str(P),
        "--overlap-steps",
        str(tau),
    ],  # fmt: skip
}
SERVER_WORKERS = 2
# gRPC honours these: a proxy outside the namespaces is unreachable from them
_PROXIES = {"http_proxy", "https_proxy", "all_proxy", "grpc_proxy"}


def _supervise(procs: list[subprocess.Popen], t0: float, timeout_s: float) -> None:
    """Wait for every process; once one has failed, give the others 10 s to end by themselves
    (a peer that lost its partner) before killing them; kill everything at timeout_s."""
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.perf_counter()
            if (failed_at and time.perf_counter() - failed_at > 10) or time.perf_counter() - t0 > timeout_s:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill(p)


def _failure(
    procs: list[subprocess.Popen], names: list[str], logs: list[Path], timeout_s: float, usage: set[int]
) -> dict | None:
    """{"error": ...} naming the process that failed by itself (the others may only have been
    killed by us), None when all exited 0. Exit 2 of a process in `usage` is a flag its CLI
    refuses (not there yet, or a bad value): the error is its message alone."""
    codes = [p.returncode for p in procs]
    if not any(codes):
        return None
    i = next((i for i, c in enumerate(codes) if c not in (0, -signal.SIGKILL)), None)
    how = f"exited {codes[i]}" if i is not None else f"timed out after {timeout_s:.0f} s"
    i = i or 0
    lines = [x for x in logs[i].read_text(errors="replace").splitlines() if x.strip()]
    last = lines[-1] if lines else f"exit code {codes[i]}"
    if codes[i] == 2 and i in usage:
        return {"error": last}
    return {"error": f"{names[i]} {how}: {last}"}


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
    _supervise(procs, t0, timeout_s)
    wall_s = time.perf_counter() - t0
    failed = _failure(procs, ["rank 0", "rank 1"], logs, timeout_s, usage={0, 1})
    if failed:
        return failed
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "compute_utilisation": s.get("compute_utilisation"),
        "val_loss": s["val_loss"],
        "compute_s": s.get("compute_s"),
        "comm_s": s.get("comm_s"),
        "bytes_sent_per_worker": s["bytes_sent_per_worker"],
        "bytes_sent": s["bytes_sent"],
        "bytes_received": s["bytes_received"],
        "params": s["params"],
        "rounds": s["outer_updates"],
        "wall_s": round(wall_s, 2),
    }


def run_server_config(
    star: Star,
    flags: list[str],
    *,
    run_dir: Path,
    port: int,
    timeout_s: float,
    worker_flags: list[list[str]] | None = None,
) -> dict:
    """`diloco serve` with `flags` in the hub, listening on its hub address, and one `diloco
    worker` in each worker namespace (worker w with `worker_flags[w - 1]`, e.g. --slowdown),
    started once the server listens; summary.json's numbers, or {"error": ...}."""
    env = {
        **{k: v for k, v in os.environ.items() if k.lower() not in _PROXIES},
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "DILOCO_TOKEN": secrets.token_urlsafe(24),  # server and workers share it, as deployed
    }
    names = ["server", *(f"worker {w}" for w in range(1, star.workers + 1))]
    logs = [run_dir.parent / f"{run_dir.name}.{n.replace(' ', '')}.log" for n in names]
    cmd = [
        *star.exec(0), sys.executable, "-m", "diloco", "serve", "--host", star.hub_addr, "--port", str(port),
        "--http-port", "-1", "--threads", "1", "--no-progress", "--out", str(run_dir), *flags,
    ]  # fmt: skip
    with open(logs[0], "w") as f:
        procs = [_spawn(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)]
    t0 = time.perf_counter()
    address = None
    # the workers would retry until it listens, but started together they register together
    while address is None and procs[0].poll() is None and time.perf_counter() - t0 < timeout_s:
        try:
            address = json.loads((run_dir / "server.json").read_text())["address"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    if address is not None:
        for w in range(1, star.workers + 1):
            cmd = [*star.exec(w), sys.executable, "-m", "diloco", "worker", "--server", address]
            cmd += ["--threads", "1", *(worker_flags[w - 1] if worker_flags else [])]
            with open(logs[w], "w") as f:
                procs.append(_spawn(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    _supervise(procs, t0, timeout_s)
    wall_s = time.perf_counter() - t0
    failed = _failure(procs, names, logs, timeout_s, usage={0})
    if failed:
        return failed
    s = json.loads((run_dir / "summary.json").read_text())
    ws = s["workers"]
    return {
        "compute_utilisation": s.get("compute_utilisation"),  # as the collective rows'
        "workers_compute_utilisation": [w["compute_utilisation"] for w in ws],
        "workers_train_s": [w.get("train_s") for w in ws],
        "val_loss": s["val_loss"],
        "compute_s": s.get("compute_s"),
        "comm_s": s.get("comm_s"),
        "bytes_sent_per_worker": s["bytes_sent_per_worker"],
        "bytes_sent": s["bytes_sent"],
        "bytes_received": s["bytes_received"],
        "wire_bytes_sent": [w["wire_bytes_sent"] for w in ws],
        "wire_bytes_received": [w["wire_bytes_received"] for w in ws],
        "params": s["params"],
        "rounds": s["outer_updates"],
        "eval_time_s": s.get("eval_time_s"),
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
    ports = iter(range(29401, 29500))  # a fresh port per run: no TIME_WAIT from the last one
    step_s = model_bytes = None

    def budget(n_rounds: int) -> float:
        # generous: a round is ~2-3 H steps at the calibrated rate, plus start-up and evals
        return 300 + 10 * n_rounds * inner_steps * (step_s or 1.0)

    def evals(n_rounds: int) -> list[str]:
        # one evaluation, at the end: rank 0 (the server) evaluating between rounds would count
        # as the other rank's (the workers') communication time
        return ["--eval-every", str(n_rounds * inner_steps)]

    def train(link: Link, name: str, flags: list[str], n_rounds: int) -> dict:
        row = run_config(
            link,
            [*base, "--rounds", str(n_rounds), *evals(n_rounds), *flags],
            run_dir=root / name,
            port=next(ports),
            timeout_s=budget(n_rounds),
        )
        log(f"{name}: {row}")
        return row

    def serve(star: Star, name: str, flags: list[str]) -> dict:
        run = ["--method", "diloco", "--workers", str(star.workers), "--rounds", str(rounds)]
        row = run_server_config(
            star,
            [*base, *run, "--checkpoint-every", str(rounds), *evals(rounds), *flags],
            run_dir=root / name,
            port=next(ports),
            timeout_s=budget(rounds),
        )
        log(f"{name}: {row}")
        return row

    collective = [c for c in configs if c in CONFIGS]
    served = [c for c in configs if c in SERVER_CONFIGS]
    rows: dict[str, dict] = {}
    calibration = each_way = star_each_way = burst_bytes = None
    if collective or link_mbps is None:
        with Link() as link:
            log(f"namespaces {link.ns[0]} ({link.addr[0]}) and {link.ns[1]} ({link.addr[1]})")
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
                mb = model_bytes / 1e6
                log(f"step {step_s * 1000:.1f} ms, model {mb:.3f} MB: link {link_mbps:.2f} Mbit/s")
            if collective:
                link.shape(link_mbps)
                burst_bytes = link.burst_bytes
                nbytes = max(1_000_000, int(link_mbps * 1e6 / 8 * 2))  # ~2 s each way
                each_way = [round(link.measure_mbps(nbytes, sender=s), 3) for s in (1, 0)]
                log(f"shaped {link_mbps:.2f} Mbit/s (burst {burst_bytes} B): measured {each_way} Mbit/s")
            for name in collective:
                flags = CONFIGS[name](fragments, overlap_steps)
                log(f"{name}: {rounds} rounds of H={inner_steps}, {' '.join(flags)}")
                rows[name] = {"flags": flags, **train(link, name, flags, rounds)}
    if served:
        with Star(SERVER_WORKERS, link_mbps) as star:
            burst_bytes = star.burst_bytes
            log(f"hub {star.ns[0]} ({star.hub_addr}), workers {', '.join(star.ns[1:])}")
            # the two directions a round uses, and both workers' links: worker 1 pushing to the
            # server's address, the server sending to worker 2
            nbytes = max(1_000_000, int(link_mbps * 1e6 / 8 * 2))
            star_each_way = [
                round(star.measure_mbps(nbytes, worker=1, to=star.hub_addr), 3),
                round(star.measure_mbps(nbytes, worker=2, sender=0), 3),
            ]
            log(f"star shaped {link_mbps:.2f} Mbit/s per link: measured {star_each_way} Mbit/s")
            for name in served:
                flags = SERVER_CONFIGS[name](fragments, overlap_steps)
                log(f"{name}: {rounds} rounds of H={inner_steps}, {' '.join(flags)}")
                rows[name] = {"flags": flags, **serve(star, name, flags)}
    if step_s is None:  # --link-mbps: the fp32 run's own step time
        fp32 = next((rows[n] for n in ("fp32", "server_fp32") if rows.get(n, {}).get("compute_s")), None)
        step_s = fp32["compute_s"] / (rounds * inner_steps) if fp32 else None
    if model_bytes is None:
        model_bytes = next((r["params"] * 4 for r in rows.values() if "params" in r), None)
    for row in rows.values():
        if row.get("comm_s") is not None:
            row["exchange_s"] = round(row["comm_s"] / rounds, 3)  # measured, per round
    result = {
        "benchmark": "wan",
        "model": "tiny (--quick)" if quick else "nano",
        "ranks": 2,
        "server_workers": SERVER_WORKERS if served else None,
        "threads_per_rank": 1,
        "H": inner_steps,
        "rounds": rounds,
        "step_s": round(step_s, 5) if step_s else None,
        "model_bytes": model_bytes,
        "link_mbps": round(link_mbps, 3),
        "measured_link_mbps": min(each_way) if each_way else None,
        "measured_link_mbps_each_way": each_way,
        "measured_star_mbps": min(star_each_way) if star_each_way else None,
        "measured_star_mbps_each_way": star_each_way,
        "fp32_exchange_s_expected": round(model_bytes * 8 / (link_mbps * 1e6), 3) if model_bytes else None,
        "tbf": {"burst_bytes": burst_bytes, "latency_ms": QUEUE_MS},
        "fragments": fragments,
        "overlap_steps": overlap_steps,
    }
    for name, row in rows.items():
        result[f"utilisation_{name}"] = row.get("compute_utilisation")
        result[f"final_loss_{name}"] = row.get("val_loss")
    for codec in ("fp32", "fp4"):  # sync streaming is deterministic: the link changes no number
        name = f"server_streaming_{codec}"
        if name in rows and rows[name].get("val_loss") is not None:
            unshaped = _simulated(rows[name]["flags"], base, rounds, evals(rounds), root / f"{name}_sim")
            result[f"final_loss_{name}_unshaped"] = unshaped
            result[f"{name}_loss_gap"] = round(rows[name]["val_loss"] / unshaped - 1, 6)
    a, b = result.get("final_loss_streaming"), result.get("final_loss_fp32")
    result["streaming_loss_gap"] = round(a / b - 1, 5) if a is not None and b else None
    result["configs"] = rows
    if calibration is not None:
        result["calibration"] = calibration
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


def _simulated(flags: list[str], base: list[str], rounds: int, evals: list[str], out: Path) -> float:
    """The final loss of the same server run in the simulator, no link at all (its reference)."""
    cmd = [sys.executable, "-m", "diloco", "train", *base, "--workers", str(SERVER_WORKERS)]
    cmd += ["--rounds", str(rounds), *evals, *flags, "--procs", "1", "--threads", "1", "--no-progress"]
    subprocess.run(
        [*cmd, "--out", str(out)], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    return json.loads((out / "summary.json").read_text())["val_loss"]


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
    everything = [*CONFIGS, *SERVER_CONFIGS]
    parser.add_argument(
        "--configs",
        default=",".join(everything),
        help="which rows, comma-separated (collective ones run first; default: all)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="where to save the JSON (default: benchmarks/results/wan.json; --quick: none)",
    )
    parser.add_argument("--keep", metavar="DIR", help="keep every row's run directory under DIR")
    args = parser.parse_args()
    reason = missing()
    if reason:
        print(reason, file=sys.stderr)
        sys.exit(2)
    H = args.inner_steps or (4 if args.quick else 50)
    rounds = args.rounds or (2 if args.quick else 6)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in everything]
    if unknown or not configs:
        parser.error(f"unknown configuration {unknown[0]!r}" if unknown else "no configuration")
    out = args.out or (None if args.quick else str(RESULTS / "wan.json"))
    install_signal_handlers()
    for name in sweep_stale():
        log(f"deleted {name}, left by a wan.py that was killed")
    if args.keep:  # the run directories stay, to look into (events.jsonl, metrics.jsonl)
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with (
        contextlib.nullcontext(args.keep)
        if args.keep
        else tempfile.TemporaryDirectory(prefix="diloco-wan-") as tmp
    ):
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
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"saved {out}")
    else:
        log("not saved (--quick; --out FILE saves it)")


if __name__ == "__main__":
    main()
