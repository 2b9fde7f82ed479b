"""The parameter server's capacity at real model sizes (issue 33): many workers pushing
real-sized outer_grads at once, against the same bytes through raw gRPC and a raw disk write.

One row = (model, codec, workers, storage). A real `diloco serve` (async, DN with N = k, no
DyLU, no grace window, jobs of one inner step, the run directory on `storage`: `disk` is the
system's temporary directory, `tmpfs` /dev/shm) and one load-generator process of `workers`
threads, each its own gRPC channel and a registered worker with no model and no training: it
gets a job (θ's download, read and dropped), pushes a precomputed outer_grad of the model's
shapes through the codec (values ~1e-3, so the outer steps are real and finite), and again,
until the run's budget is spent (`--pushes` per worker). Measured over the pushing part (from
every worker registered to the last acknowledgment):

- `pushes_per_s`, `mb_per_s` (pushed bytes per second), client-side `push_latency_ms_p50/p99`
  (first chunk sent to acknowledgment);
- `cpu_s_per_push`: the server process's user + system CPU seconds ÷ pushes;
- `peak_rss_over_idle_mb`: the server's largest resident set while pushes run (sampled every
  20 ms) minus its resident set once ready and idle; `peak_rss_file_mb`: how much of that
  largest resident set was pages of mapped files (push files being checked or applied);
- `acknowledged` (by the clients), `logged` (push events in events.jsonl), `applied` (apply
  events): equal when nothing was lost or applied twice;
- `raw_grpc_mb_per_s`: the same threads doing the same downloads and uploads, in the same 1 MB
  chunks, against a gRPC server in its own process that does nothing else;
- `raw_disk_mb_per_s`: the same threads each writing the message to a file on `storage` and
  fsyncing it, `--pushes` times;
- `throughput_ratio` = `mb_per_s` ÷ the slower of the two raw paths (which one: `limit`).

fp4 rows push `--codec fp4` messages (0.52 bytes per value) and download θ in bf16
(`--download-codec bf16`), as wan.py's fp4 server rows do; fp32 rows move fp32 both ways.

    python benchmarks/server_capacity.py                       # the default matrix (see --help)
    python benchmarks/server_capacity.py --model 150m --codec fp32 --workers 16   # one row

Writes benchmarks/results/server_capacity.json (rows merged by their key: model, codec, workers,
storage, `--max-inflight-pushes` and `--max-inflight-downloads`; so rows run one at a time
accumulate, and a row run again keeps its place; `--out` elsewhere), and the capacity table of
docs/server.md computed from its rows (`capacity`; `--capacity` recomputes it alone and prints it).
A row whose server dies (out of memory, say) is reported with its `error` and the server's last
line; a row whose push files would not fit its storage (they are kept to the run's end: 150m
fp32 x 16 is 22 GB, memory on tmpfs) is not run, and says so in its `error`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

CHUNK = 1 << 20
RESULTS = Path(__file__).parent / "results"
_RAW = "/raw.Raw/"
OPTS = [("grpc.max_receive_message_length", 4 * CHUNK), ("grpc.max_send_message_length", 4 * CHUNK)]
STORAGE = {"disk": Path(tempfile.gettempdir()), "tmpfs": Path("/dev/shm")}


def _raw_server(port: int, down_bytes: int, threads: int) -> None:
    """The baseline: stream `down_bytes` down, take a stream up; nothing else."""
    blob = os.urandom(down_bytes)

    def down(request, ctx):
        for at in range(0, len(blob), CHUNK):
            yield blob[at : at + CHUNK]

    def up(chunks, ctx):
        return sum(len(c) for c in chunks).to_bytes(8, "little")

    handlers = {
        "Down": grpc.unary_stream_rpc_method_handler(down),
        "Up": grpc.stream_unary_rpc_method_handler(up),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * threads + 4), options=OPTS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("raw.Raw", handlers),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _proc_stat(pid: int) -> tuple[float, float, float]:
    """(user + system CPU seconds, resident MB, of which mapped files) of process `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    status = dict(x.split(":", 1) for x in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in x)
    return cpu, rss, int(status.get("RssFile", "0 kB").split()[0]) / 1e3


class _Sampler(threading.Thread):
    """(time, CPU seconds, resident MB, of which mapped files) of `pid` every 20 ms while it runs."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            try:
                self.samples.append((time.perf_counter(), *_proc_stat(self.pid)))
            except (FileNotFoundError, ProcessLookupError):
                return

    def until(self, t: float) -> tuple[float, float, float]:
        """The CPU seconds at the last sample before `t`, the largest resident set until it and
        the mapped files' part of it then."""
        before = [s for s in self.samples if s[0] <= t] or self.samples[:1]
        peak = max(before, key=lambda s: s[2])
        return before[-1][1], peak[2], peak[3]


def _message(model: str, codec: str) -> tuple[bytes, int]:
    """A precomputed outer_grad message of `model`'s shapes through `codec`, and θ's size as
    the server sends it (fp32, or bf16 with fp4)."""
    import torch

    from diloco.config import MODEL_PRESETS
    from diloco.core.codec import build_codec
    from diloco.model.gpt import GPT

    with torch.device("meta"):
        shapes = [p.shape for p in GPT(MODEL_PRESETS[model]).parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
    message = build_codec(codec).encode(grads, {}).to_bytes()
    params = sum(s.numel() for s in shapes)
    return message, params * (2 if codec == "fp4" else 4)


def _clients(workers: int, body) -> tuple[float, list]:
    """`workers` threads each running body(i, barrier) -> rows (push seconds, pushed bytes,
    ...); the time they all passed the barrier, and every thread's rows."""
    rows: list = [None] * workers
    errors: list = []
    barrier = threading.Barrier(workers + 1)

    def run(i: int) -> None:
        try:
            rows[i] = body(i, barrier)
        except BaseException as e:  # reported, not swallowed
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return t0, [r for rs in rows for r in rs]


def _diloco_row(
    model: str,
    codec: str,
    workers: int,
    root: Path,
    pushes: int,
    message: bytes,
    inflight: int,
    downloads: int,
) -> dict:
    from diloco.runtime.server import diloco_pb2 as pb
    from diloco.runtime.server import diloco_pb2_grpc as rpc
    from diloco.runtime.server.wire import PROTOCOL, push_chunks

    token = secrets.token_urlsafe(32)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "DILOCO_TOKEN": token}
    meta = (("authorization", f"Bearer {token}"),)
    run = Path(tempfile.mkdtemp(prefix="diloco-capacity-", dir=root)) / "run"
    steps = pushes * workers + 1  # each job one step; the budget is pushes x workers jobs
    codec_flags = ["--codec", codec] + (
        ["--error-feedback", "--download-codec", "bf16"] if codec == "fp4" else []
    )
    cmd = [
        sys.executable, "-m", "diloco", "serve", "--out", str(run), "--port", "0", "--threads", "2",
        "--method", "async", "--workers", str(workers), "--inner-steps", "1", "--rounds", str(pushes),
        "--no-dylu", "--grace-s", "0", "--model", model, *codec_flags, "--eval-every", str(steps),
        "--checkpoint-every", str(steps), "--http-port", "-1", "--no-progress",
        "--worker-timeout-s", "600", "--max-inflight-pushes", str(inflight),
        *(["--max-inflight-downloads", str(downloads)] if downloads else []),
    ]  # fmt: skip
    log = open(run.parent / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while not (run / "server.json").exists():
            if proc.poll() is not None:
                raise RuntimeError(_last_line(run.parent / "server.log"))
            time.sleep(0.2)
        address = json.loads((run / "server.json").read_text())["address"]
        time.sleep(1.0)
        cpu0, idle_rss, _ = _proc_stat(proc.pid)
        sampler = _Sampler(proc.pid)
        sampler.start()

        def worker(i: int, barrier) -> list:
            stub = rpc.ParameterServerStub(grpc.insecure_channel(address, options=OPTS))
            request = pb.RegisterRequest(
                name=f"load-{i}", device="cpu", protocol=PROTOCOL, nonce=secrets.token_hex(8)
            )
            reg = stub.Register(request, timeout=600, metadata=meta)
            ref = pb.WorkerRef(worker=reg.worker, run_id=reg.run_id, token=reg.token)
            barrier.wait()
            rows = []
            while True:
                chunks = stub.GetJob(ref, timeout=600, metadata=meta)
                head = next(chunks)
                for _ in chunks:  # θ: read and dropped
                    pass
                if head.status == pb.JobChunk.DONE:
                    return rows
                if head.status == pb.JobChunk.WAIT:
                    time.sleep(head.retry_s)
                    continue
                push = pb.PushChunk(
                    worker=ref.worker, run_id=ref.run_id, token=ref.token, job=head.job, steps=head.steps,
                    mean_loss=1.0, last_lr=1e-3, finite=True, compute_s=1e-3, total_bytes=len(message),
                    version=head.version,
                )  # fmt: skip
                t0 = time.perf_counter()
                reply = stub.Push(push_chunks(push, message), timeout=600, metadata=meta)
                t1 = time.perf_counter()
                rows.append((t1 - t0, len(message), reply.status == pb.PushReply.ACCEPTED, t1))

        start, rows = _clients(workers, worker)
        # the pushing part: to the last acknowledgment (not the run's end, its final evaluation)
        last = max(r[3] for r in rows)
        wall = last - start
        while not sampler.samples or sampler.samples[-1][0] < last:
            time.sleep(0.02)
        sampler.stop.set()
        cpu_start = next((s[1] for s in sampler.samples if s[0] >= start), cpu0)
        cpu_end, peak, peak_file = sampler.until(last)
        events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        acked = sum(1 for r in rows if r[2])
        latencies = [r[0] * 1e3 for r in rows]
        return {
            "pushes_per_s": round(len(rows) / wall, 3),
            "mb_per_s": round(sum(r[1] for r in rows) / wall / 1e6, 2),
            "push_latency_ms_p50": round(statistics.median(latencies), 2),
            "push_latency_ms_p99": round(_percentile(latencies, 0.99), 2),
            "cpu_s_per_push": round((cpu_end - cpu_start) / max(1, len(rows)), 4),
            "peak_rss_over_idle_mb": round(max(0.0, peak - idle_rss), 1),
            "peak_rss_file_mb": round(peak_file, 1),  # of the peak: pages of mapped files (pushes)
            "idle_rss_mb": round(idle_rss, 1),
            "acknowledged": acked,
            "logged": sum(1 for e in events if e["kind"] == "push"),
            "applied": sum(1 for e in events if e["kind"] == "apply"),
            "wall_s": round(wall, 2),
        }
    finally:
        proc.kill()
        proc.wait()
        log.close()
        subprocess.run(["rm", "-rf", str(run.parent)], check=False)


def _last_line(path: Path) -> str:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else "(no output)"


def _raw_grpc(workers: int, pushes: int, message: bytes, down_bytes: int) -> float:
    """Pushed MB/s of `workers` threads doing `pushes` download-then-upload cycles each."""
    raw = subprocess.Popen(
        [sys.executable, __file__, "--raw-server", "0", "--raw-bytes", str(down_bytes),
         "--raw-threads", str(workers)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        port = int(raw.stdout.readline())

        def body(i: int, barrier) -> list:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTS)
            down, up = channel.unary_stream(_RAW + "Down"), channel.stream_unary(_RAW + "Up")
            barrier.wait()
            rows = []
            for _ in range(pushes):
                for _ in down(b"", timeout=600):
                    pass
                t0 = time.perf_counter()
                up((message[at : at + CHUNK] for at in range(0, len(message), CHUNK)), timeout=600)
                rows.append((time.perf_counter() - t0, len(message), True, time.perf_counter()))
            return rows

        start, rows = _clients(workers, body)
        return sum(r[1] for r in rows) / (max(r[3] for r in rows) - start) / 1e6
    finally:
        raw.kill()
        raw.wait()


def _raw_disk(workers: int, pushes: int, message: bytes, root: Path) -> float:
    """MB/s of `workers` threads each writing the message to its own file and fsyncing it."""
    where = Path(tempfile.mkdtemp(prefix="diloco-capacity-disk-", dir=root))
    try:

        def body(i: int, barrier) -> list:
            barrier.wait()
            rows = []
            for j in range(pushes):
                path = where / f"{i}-{j}"
                with open(path, "wb", buffering=0) as f:
                    view = memoryview(message)
                    while view:
                        view = view[f.write(view[: 8 * CHUNK]) :]
                    os.fsync(f.fileno())
                path.unlink()  # the server's log is cut at checkpoints; do not fill the disk
                rows.append((0.0, len(message), True, time.perf_counter()))
            return rows

        start, rows = _clients(workers, body)
        return sum(r[1] for r in rows) / (max(r[3] for r in rows) - start) / 1e6
    finally:
        subprocess.run(["rm", "-rf", str(where)], check=False)


def row(
    model: str, codec: str, workers: int, storage: str, pushes: int, inflight: int = 0, downloads: int = 0
) -> dict:
    message, down_bytes = _message(model, codec)
    root = STORAGE[storage]
    out = {"model": model, "codec": codec, "workers": workers, "storage": storage}
    out |= {"message_bytes": len(message), "download_bytes": down_bytes, "pushes_per_worker": pushes}
    out["max_inflight_pushes"] = inflight  # 0: the server's default (from its memory)
    out["max_inflight_downloads"] = downloads  # 0: the server's default (1)
    if problem := no_room(root, workers * pushes * len(message)):
        print(f"[capacity] skipped: {problem}", file=sys.stderr, flush=True)
        out["error"] = problem
        return out
    try:
        out |= _diloco_row(model, codec, workers, root, pushes, message, inflight, downloads)
    except (RuntimeError, grpc.RpcError) as e:
        out["error"] = str(e)[-500:]
        return out
    out["raw_grpc_mb_per_s"] = round(_raw_grpc(workers, pushes, message, down_bytes), 2)
    out["raw_disk_mb_per_s"] = round(_raw_disk(workers, pushes, message, root), 2)
    slower = min(out["raw_grpc_mb_per_s"], out["raw_disk_mb_per_s"])
    out["limit"] = "grpc" if out["raw_grpc_mb_per_s"] <= out["raw_disk_mb_per_s"] else "disk"
    out["throughput_ratio"] = round(out["mb_per_s"] / slower, 4)
    return out


def no_room(root: Path, push_bytes: int) -> str | None:
    """Why a row's run cannot fit `root` (None if it can): the server keeps every push's file
    until its next checkpoint, which this benchmark puts at the run's end, so the pushes must
    fit beside what is there. On tmpfs they are memory, and the server and the load generator
    need memory too: they may take half of what is available (150m fp32 x 16 is 22 GB, and the
    kernel killed the server; free space on a 24 GB tmpfs did not say so)."""
    free = shutil.disk_usage(root).free
    if not memory_backed(root):
        if push_bytes <= 0.9 * free:
            return None
        return (
            f"the run's push files ({push_bytes / 1e9:.1f} GB, kept until its end) do not fit {root} "
            f"({free / 1e9:.1f} GB free); run this row with --storage disk or fewer --pushes"
        )
    room = min(free, mem_available())
    if push_bytes <= 0.5 * room:
        return None
    return (
        f"the run's push files ({push_bytes / 1e9:.1f} GB, kept until its end) would take more than "
        f"half of the memory left ({room / 1e9:.1f} GB), since {root} is memory; run this row with "
        "--storage disk or fewer --pushes"
    )


def memory_backed(root: Path) -> bool:
    """Whether `root` is on a tmpfs (or ramfs): its files are memory."""
    where, fstype = "", ""
    for line in Path("/proc/mounts").read_text().splitlines() if Path("/proc/mounts").exists() else []:
        point, kind = line.split()[1], line.split()[2]
        if str(root.resolve()).startswith(point.rstrip("/") + "/") or str(root.resolve()) == point:
            if len(point) > len(where):
                where, fstype = point, kind
    return fstype in ("tmpfs", "ramfs")


def mem_available() -> int:
    """The kernel's estimate of memory available to new work (bytes)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# The capacity table (docs/server.md, "Capacity"): from the measured rows, per-parameter costs
CAPACITY_PARAMS = {"150M": 150e6, "1B": 1e9, "10B": 10e9}
CAPACITY_LINKS_GBIT = (0.1, 1.0, 10.0)
CAPACITY_H = (100, 500)
CAPACITY_STEP_S = 1.0  # a worker's seconds per inner step (an assumption: scale k with it)
CAPACITY_CORES = 2  # the cores the measured server had (this machine)
# the rows the costs come from: the largest message of each codec, 16 workers, run dir on disk
CAPACITY_FROM = {"fp32": ("150m", 16), "fp4": ("150m", 16)}
DOWNLOAD_BYTES_PER_PARAM = {"fp32": 4, "fp4": 2}  # fp4 rows download θ in bf16


def capacity(rows: list[dict]) -> dict:
    """How many workers one server sustains, per (model size, codec, link speed): the pushes per
    second each resource allows, from per-parameter costs measured in `rows` (server CPU
    seconds, bytes up and down, the disk's write + fsync speed, memory at rest), and the
    resource that runs out first. A push comes with one download of θ."""

    def find(model: str, codec: str, workers: int) -> dict:
        return next(
            r
            for r in rows
            if (r["model"], r["codec"], r["workers"], r["storage"]) == (model, codec, workers, "disk")
            and not r.get("max_inflight_pushes")
            and not r.get("max_inflight_downloads")
            and "error" not in r
        )

    costs = {}
    for codec, (model, workers) in CAPACITY_FROM.items():
        r = find(model, codec, workers)
        params = r["download_bytes"] / DOWNLOAD_BYTES_PER_PARAM[codec]
        costs[codec] = {
            "from_row": f"{model} {codec} x{workers} disk",
            "cpu_s_per_gparam": round(r["cpu_s_per_push"] / params * 1e9, 2),  # per 10^9 parameters
            "up_bytes_per_param": round(r["message_bytes"] / params, 4),
            "down_bytes_per_param": DOWNLOAD_BYTES_PER_PARAM[codec],
        }
    big, small = find("150m", "fp32", 16), find("nano", "fp32", 16)
    per_param = (
        (big["idle_rss_mb"] - small["idle_rss_mb"])
        * 1e6
        / ((big["message_bytes"] - small["message_bytes"]) / 4)
    )
    disk_mb_per_s = big["raw_disk_mb_per_s"]
    table = []
    for name, n in CAPACITY_PARAMS.items():
        for codec, c in costs.items():
            for gbit in CAPACITY_LINKS_GBIT:
                limits = {
                    "link": gbit * 1e9 / 8 / ((c["up_bytes_per_param"] + c["down_bytes_per_param"]) * n),
                    "disk": disk_mb_per_s * 1e6 / (c["up_bytes_per_param"] * n),
                    "cpu": CAPACITY_CORES / (c["cpu_s_per_gparam"] * n / 1e9),
                }
                first = min(limits, key=limits.get)
                table.append(
                    {
                        "model": name,
                        "codec": codec,
                        "link_gbit_s": gbit,
                        "pushes_per_s": {k: round(v, 4) for k, v in limits.items()},
                        "runs_out_first": first,
                        "server_pushes_per_s": round(limits[first], 4),
                        **{
                            f"workers_H{h}": _workers(limits[first] * h * CAPACITY_STEP_S) for h in CAPACITY_H
                        },
                        "memory_at_rest_gb": round(per_param * n / 1e9, 1),
                    }
                )
    return {
        "step_s": CAPACITY_STEP_S,
        "cores": CAPACITY_CORES,
        "disk_mb_per_s": disk_mb_per_s,
        "memory_at_rest_bytes_per_param": round(per_param, 1),
        "costs": costs,
        "table": table,
    }


def _workers(k: float) -> float:
    """Workers a push rate sustains, rounded down: whole ones from 10 up, tenths below (0.3: the
    server keeps up with a third of one worker)."""
    return float(int(k)) if k >= 10 else int(k * 10) / 10


def capacity_markdown(cap: dict) -> str:
    """The table of docs/server.md's "Capacity" section (tests/unit/test_capacity_table.py keeps
    the two equal)."""
    head = ["model", "codec", "link", "pushes/s: link / disk / CPU", "runs out first"]
    head += [f"workers at H = {h}" for h in CAPACITY_H] + ["server memory at rest"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in cap["table"]:
        p = t["pushes_per_s"]
        link = (
            f"{t['link_gbit_s'] * 1000:g} Mbit/s" if t["link_gbit_s"] < 1 else f"{t['link_gbit_s']:g} Gbit/s"
        )
        cells = [t["model"], t["codec"], link, f"{p['link']:.3g} / {p['disk']:.3g} / {p['cpu']:.3g}"]
        cells += [f"**{t['runs_out_first']}**"] + [f"{t[f'workers_H{h}']:g}" for h in CAPACITY_H]
        cells += [f"{t['memory_at_rest_gb']:g} GB"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nano,micro,20m", help="presets, comma-separated (150m: 692 MB fp32)")
    ap.add_argument("--codec", default="fp32,fp4", help="fp32 and/or fp4, comma-separated")
    ap.add_argument("--workers", default="1,16", help="concurrent workers, comma-separated")
    ap.add_argument("--storage", default="disk,tmpfs", help="disk and/or tmpfs, comma-separated")
    ap.add_argument("--pushes", type=int, default=None, help="pushes per worker (default: by message size)")
    ap.add_argument(
        "--max-inflight-pushes",
        type=int,
        default=0,
        help="the server's --max-inflight-pushes (0: its default)",
    )
    ap.add_argument(
        "--max-inflight-downloads",
        type=int,
        default=0,
        help="the server's --max-inflight-downloads (0: its default)",
    )
    ap.add_argument("--out", default=str(RESULTS / "server_capacity.json"))
    ap.add_argument(
        "--capacity",
        action="store_true",
        help="only recompute the capacity table from the saved rows (and print it as markdown)",
    )
    ap.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--raw-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--raw-threads", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_server is not None:
        return _raw_server(args.raw_server, args.raw_bytes, args.raw_threads)
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.exists() else {"benchmark": "server_capacity", "rows": []}
    key = ("model", "codec", "workers", "storage", "max_inflight_pushes", "max_inflight_downloads")
    for model in [] if args.capacity else args.model.split(","):
        for codec in args.codec.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                for storage in args.storage.split(","):
                    pushes = args.pushes or {"nano": 20, "micro": 10, "20m": 4}.get(model, 2)
                    print(
                        f"[capacity] {model} {codec} x{workers} on {storage} ...", file=sys.stderr, flush=True
                    )
                    limits = (args.max_inflight_pushes, args.max_inflight_downloads)
                    r = row(model, codec, workers, storage, pushes, *limits)
                    print(f"[capacity] {json.dumps(r)}", file=sys.stderr, flush=True)
                    same = [
                        i
                        for i, x in enumerate(saved["rows"])
                        if tuple(x.get(k, 0) for k in key) == tuple(r[k] for k in key)
                    ]
                    if same:  # a row run again keeps its place (docs cite rows by index)
                        saved["rows"][same[0]] = r
                    else:
                        saved["rows"].append(r)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(saved, indent=2) + "\n")
    try:
        saved["capacity"] = capacity(saved["rows"])
    except StopIteration:
        print("[capacity] no table: it needs the rows 150m fp32 x16, nano fp32 x16, 20m fp4 x16 on disk")
    out.write_text(json.dumps(saved, indent=2) + "\n")
    if args.capacity:
        print(capacity_markdown(saved["capacity"]))
        return
    print(json.dumps(saved, indent=2))


if __name__ == "__main__":
    main()
