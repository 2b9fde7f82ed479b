"""The parameter server's transport cost, on loopback.

One client does what a worker does with no inner steps: get a job (the global parameters, in
1 MB chunks) and push an outer_grad of the same size, again and again, against
(a) a real `diloco serve` (async, one worker slot, DN with N = 1: every push is logged durably
    in the write-ahead log, applied, and the next job, from the new θ, is logged and handed out);
(b) a raw gRPC server in its own process that streams the same bytes down and takes the same
    bytes up, in the same chunks, and does nothing else;
(c) the same raw server that also appends each upload to a file on the same disk and
    fdatasyncs it before replying (`raw_durable`: what a durable acknowledgment costs alone).
Blocks of cycles alternate between them. Reported: `throughput_ratio` (diloco's cycles/s ÷
raw's; target ≥ 0.8), `durable_throughput_ratio` (÷ raw_durable's), MB/s, the push latency
through diloco (`push_latency_ms_p50`, `push_latency_ms_p99`) next to raw's, with the
difference as the server's added latency, and the CPU each cycle costs the server's process and
the client's (`server_cpu_ms_per_cycle`, `client_cpu_ms_per_cycle`; from /proc: Linux).

    python benchmarks/server_transport.py            # ~1 minute; --model micro for 11 MB messages
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
from server_capacity import _proc_stat

CHUNK = 1 << 20
_RAW = "/raw.Raw/"


def _raw_server(port: int, nbytes: int, sync_dir: str | None = None) -> None:
    """The baseline: stream `nbytes` down, take a stream up; nothing else, or (`sync_dir`) also
    append what came up to a file there and fdatasync it before replying, as a durable
    acknowledgment must (the floor of any server that logs a push before acknowledging it)."""
    blob = os.urandom(nbytes)
    log = os.open(Path(sync_dir) / "raw.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if sync_dir else None

    def down(request, ctx):
        for at in range(0, len(blob), CHUNK):
            yield blob[at : at + CHUNK]

    def up(chunks, ctx):
        if log is None:
            return len(b"".join(chunks)).to_bytes(8, "little")
        n = 0
        for c in chunks:
            n += os.write(log, c)
        os.fdatasync(log)
        return n.to_bytes(8, "little")

    handlers = {
        "Down": grpc.unary_stream_rpc_method_handler(down),
        "Up": grpc.stream_unary_rpc_method_handler(up),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("raw.Raw", handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) of process `pid` (server_capacity's reader of
    /proc), or of this one."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    return _proc_stat(pid)[0]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="nano", help="model preset (nano: 2 MB messages)")
    ap.add_argument("--cycles", type=int, default=200, help="get-and-push cycles against each server")
    ap.add_argument("--block", type=int, default=20, help="cycles in a row before switching servers")
    ap.add_argument(
        "--tmpfs",
        default="/dev/shm",
        help="also run with the run directory (and its write-ahead log) here, in memory (default /dev/shm)",
    )
    ap.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--raw-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--raw-sync", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_server is not None:
        return _raw_server(args.raw_server, args.raw_bytes, args.raw_sync)

    import torch

    from diloco.config import MODEL_PRESETS
    from diloco.core.codec import Fp32Codec
    from diloco.model.gpt import GPT
    from diloco.runtime.server import diloco_pb2 as pb
    from diloco.runtime.server import diloco_pb2_grpc as rpc
    from diloco.runtime.server.handlers import PROTOCOL
    from diloco.runtime.server.wire import push_chunks

    torch.set_num_threads(1)
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(MODEL_PRESETS[args.model]).parameters()]
    message = Fp32Codec().encode([torch.zeros(s) for s in shapes]).to_bytes()
    token = secrets.token_urlsafe(32)  # the server checks it on every call, as in a real run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DILOCO_TOKEN": token}
    meta = (("authorization", f"Bearer {token}"),)
    jobs = args.cycles + 5
    opts = [("grpc.max_receive_message_length", 4 * CHUNK)]

    def temp_dir(prefix: str, root: Path | None = None) -> str:
        """A temporary folder removed when the benchmark exits, however it exits (the logs of a
        few hundred cycles are GBs)."""
        folder = tempfile.mkdtemp(prefix=prefix, dir=root)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return folder

    def start_server(root: Path):
        run = Path(temp_dir("diloco-transport-", root)) / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "diloco", "serve", "--out", str(run), "--port", "0", "--threads", "1",
             "--method", "async", "--workers", "1", "--inner-steps", "1", "--rounds", str(jobs),
             "--no-dylu", "--grace-s", "0", "--model", args.model, "--eval-every", str(jobs),
             "--checkpoint-every", str(jobs), "--no-progress",
             "--worker-timeout-s", "3600"],  # no heartbeats while the other servers have their turn
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while not (run / "server.json").exists():
            if proc.poll() is not None:
                raise SystemExit(f"the server failed: {proc.stderr.read()[-2000:]}")
            time.sleep(0.1)
        address = json.loads((run / "server.json").read_text())["address"]
        stub = rpc.ParameterServerStub(grpc.insecure_channel(address, options=opts))
        request = pb.RegisterRequest(name="bench", device="cpu", protocol=PROTOCOL)
        reg = stub.Register(request, timeout=60, metadata=meta)
        return proc, stub, pb.WorkerRef(worker=reg.worker, run_id=reg.run_id, token=reg.token)

    def start_raw(*sync: str):
        with socket_port() as port:
            pass
        proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-server", str(port), "--raw-bytes", str(len(message)), *sync],
            env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout.readline().strip() == "ready"
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
        return proc, channel.unary_stream(_RAW + "Down"), channel.stream_unary(_RAW + "Up")

    raws = {
        "raw": start_raw(),
        "raw_durable": start_raw("--raw-sync", temp_dir("diloco-raw-")),
    }
    servers = {"diloco": start_server(Path(tempfile.gettempdir()))}
    if args.tmpfs and Path(args.tmpfs).is_dir():
        servers["diloco_tmpfs"] = start_server(Path(args.tmpfs))

    def diloco_cycle(name: str) -> tuple[float, float, int]:
        _, stub, ref = servers[name]
        t0 = time.perf_counter()
        chunks = stub.GetJob(ref, timeout=60, metadata=meta)
        head = next(chunks)
        down = len(b"".join(c.data for c in chunks))
        assert head.status == pb.JobChunk.RUN, head
        t1 = time.perf_counter()
        push = pb.PushChunk(worker=ref.worker, run_id=ref.run_id, token=ref.token, job=head.job,
                            steps=head.steps, mean_loss=1.0, last_lr=1e-3, finite=True, compute_s=1e-3,
                            total_bytes=len(message), version=head.version)  # fmt: skip
        reply = stub.Push(push_chunks(push, message), timeout=60, metadata=meta)
        assert reply.status == pb.PushReply.ACCEPTED, reply
        return t1 - t0, time.perf_counter() - t1, down + len(message)

    def raw_cycle(name: str) -> tuple[float, float, int]:
        _, raw_down, raw_up = raws[name]
        t0 = time.perf_counter()
        down = len(b"".join(raw_down(b"", timeout=60)))
        t1 = time.perf_counter()
        raw_up(iter([message[at : at + CHUNK] for at in range(0, len(message), CHUNK)]), timeout=60)
        return t1 - t0, time.perf_counter() - t1, down + len(message)

    cycles = {name: diloco_cycle for name in servers} | dict.fromkeys(raws, raw_cycle)
    for name, cycle in cycles.items():  # warm up
        for _ in range(3):
            cycle(name)
    timed = {name: [] for name in cycles}
    cpu = {name: [0.0, 0.0] for name in cycles}  # CPU seconds of the server's process, the client's
    wall = dict.fromkeys(cycles, 0.0)
    done = 0
    while done < args.cycles:
        n = min(args.block, args.cycles - done)
        for name, cycle in cycles.items():
            server = (servers.get(name) or raws[name])[0].pid
            t0, s0, c0 = time.perf_counter(), _cpu_s(server), _cpu_s()
            timed[name] += [cycle(name) for _ in range(n)]
            wall[name] += time.perf_counter() - t0
            cpu[name][0] += _cpu_s(server) - s0
            cpu[name][1] += _cpu_s() - c0
        done += n
    for proc, _, _ in [*raws.values(), *servers.values()]:
        proc.kill()
        proc.communicate()

    def stats(name):
        rows = timed[name]
        pushes = [r[1] * 1e3 for r in rows]
        return {
            "cycles_per_s": len(rows) / wall[name],
            "mb_per_s": sum(r[2] for r in rows) / wall[name] / 1e6,
            "push_latency_ms_p50": statistics.median(pushes),
            "push_latency_ms_p99": _percentile(pushes, 0.99),
            "get_job_ms_p50": statistics.median(r[0] * 1e3 for r in rows),
            "server_cpu_ms_per_cycle": 1e3 * cpu[name][0] / len(rows),
            "client_cpu_ms_per_cycle": 1e3 * cpu[name][1] / len(rows),
        }

    d, r = stats("diloco"), stats("raw")
    result = {
        "benchmark": "server_transport",
        "model": args.model,
        "message_bytes": len(message),
        "cycles": args.cycles,
        "throughput_ratio": d["cycles_per_s"] / r["cycles_per_s"],
        "target_throughput_ratio": 0.8,
        "push_latency_ms_p50": d["push_latency_ms_p50"],
        "push_latency_ms_p99": d["push_latency_ms_p99"],
        "added_push_latency_ms_p50": d["push_latency_ms_p50"] - r["push_latency_ms_p50"],
        "server_cpu_ms_per_cycle": d["server_cpu_ms_per_cycle"],
        "raw_server_cpu_ms_per_cycle": r["server_cpu_ms_per_cycle"],
        "diloco": d,
        "raw": r,
    }
    # against raw gRPC + a durable acknowledgment (write + fdatasync on the same disk): how much
    # of the gap to raw gRPC is the disk's, which no server that logs before acknowledging avoids
    result["durable_throughput_ratio"] = d["cycles_per_s"] / stats("raw_durable")["cycles_per_s"]
    result["raw_durable"] = stats("raw_durable")
    if "diloco_tmpfs" in servers:  # the same server, its write-ahead log in memory: what durability costs
        t = stats("diloco_tmpfs")
        result["tmpfs_throughput_ratio"] = t["cycles_per_s"] / r["cycles_per_s"]
        result["diloco_tmpfs"] = t
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / f"server_transport_{args.model}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


class socket_port:
    """A free loopback port (closed again before use)."""

    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.s.close()


if __name__ == "__main__":
    main()
