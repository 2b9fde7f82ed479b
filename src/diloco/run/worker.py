"""`diloco worker`: one worker of a parameter server run, on any machine that reaches the server.

It registers (getting its id, the run's settings and the data plan: nothing to repeat on the
command line), builds its model replica, inner optimizer and data from those settings, then
loops: get a job (the global parameters, how many steps, which shard and from which position),
run the inner steps, push the outer_grad, until the server says the run is done. A heartbeat
thread keeps its lease. When the server cannot be reached the worker retries with backoff for
`--retry-s` seconds (a restarted server finds it waiting), then gives up with one sentence (exit
2); link.py holds the channel, its retries and the heartbeat. A worker whose lease ran out (the
server thought it gone) throws its state away and joins again as a fresh worker, exactly as the
server's event log records it.

    diloco worker --server localhost:7000 --threads 1
    diloco worker --server 10.0.0.5:7000 --device cuda --slowdown 2   # an emulated slower worker
    diloco worker --server 10.0.0.5:7000 --slowdown 3@60-inf          # ... 3x slower after a minute
    diloco worker --server 10.0.0.5:7000 --step-s 0.05                # an emulated 50 ms/step device
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import grpc
import torch

from diloco.config import from_dict
from diloco.core.async_policy import DEADLINE_CAP
from diloco.core.codec import Encoded
from diloco.core.inner import Worker
from diloco.data.recipe import prepare_data
from diloco.data.shard_plan import ShardPlan
from diloco.errors import Interrupted, UserError
from diloco.model.init import initial_model, load_init
from diloco.run.assemble import build_worker, download_codec
from diloco.run.group import Group
from diloco.run.link import Heartbeat, Link, Refused, RunOver, log
from diloco.run.streaming_job import streaming_job
from diloco.run.threads import set_threads
from diloco.runtime.clock import slowed
from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server.wire import PROTOCOL, push_chunks

MAX_REFUSED_IN_A_ROW = 3  # then something is wrong with this worker: it stops (exit 2)


def _emulated(step_s: float, factor: float, start: float, end: float):
    """An emulated device's time for a step that took t seconds: at least `step_s`, times
    `factor` from `start` to `end` seconds after its first inner step (runtime.clock.slowed)."""
    first: list[float] = []  # when its first step ended

    def emulated_s(t: float) -> float:
        if not first:
            first.append(time.monotonic())
        since = time.monotonic() - first[0]
        return max(t, step_s) * (factor if start <= since < end else 1.0)

    return emulated_s


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device; use cpu or cuda (cuda:N).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"--device {name} but this machine has no CUDA GPU that torch can use; use --device cpu."
        )
    return device


def run_worker(
    server: str,
    *,
    device: str = "cpu",
    threads: int = 1,
    slowdown: tuple[float, float, float] = (1.0, 0.0, math.inf),
    step_s: float = 0.0,
    retry_s: float = 60.0,
    token: str | None = None,
    tls_ca: Path | None = None,
    acks: Path | None = None,
) -> int:
    """Work for the server at `server` (HOST:PORT) until its run is done; returns the exit code.
    Under torchrun the launch's ranks are one worker (run/group.py); its leader talks to the
    server. `acks`: a file that gets one JSON line per acknowledged push (job, seconds; tests)."""
    set_threads(threads)
    group = Group.from_env(retry_s)
    dev = _device(group.device(device))
    link = Link(server, retry_s, token, tls_ca) if group.leader else None
    name = f"{socket.gethostname()}:{os.getpid()}"
    built: dict[str, tuple] = {}  # the run's settings and shard plan -> (config, data), kept across rejoins
    acked: set[int] = set()  # jobs whose push the server acknowledged
    try:
        while True:
            request = pb.RegisterRequest(
                name=name, device=str(dev), protocol=PROTOCOL, nonce=uuid.uuid4().hex, ranks=group.size
            )
            request.group = group.launch
            reg = pb.RegisterReply.FromString(group.lead(lambda r=request: _register(link, r)))
            if reg.status == pb.RegisterReply.DONE:
                if group.leader:
                    log(f"the run at {server} is over")
                return 0
            # the lease is kept from here on: tokenising the data (or training a BPE) on a first
            # join may take longer than --worker-timeout-s
            ref = pb.WorkerRef(worker=reg.worker, run_id=reg.run_id, token=reg.token)
            beat = Heartbeat(link, ref, reg.heartbeat_s) if group.leader else None
            over = beat.over if beat is not None else threading.Event()  # the leader's says for all
            try:
                run = reg.config_json + reg.shard_plan
                if run not in built:
                    cfg = from_dict(json.loads(reg.config_json), where=f"the settings sent by {server}")
                    # the server's shard plan, not one of this machine's own (older servers send none)
                    plan = reg.shard_plan and ShardPlan.from_json(reg.shard_plan, f"the server at {server}")
                    built = {
                        run: (
                            cfg,
                            group.first(lambda cfg=cfg, plan=plan: prepare_data(cfg, plan=plan or None)),
                        )
                    }
                cfg, data = built[run]
                if [len(s) for s in data.shards] != list(reg.shard_tokens):
                    raise UserError(
                        f"this worker's data shards differ from the server's ({server}); run the same "
                        "diloco on both, with the same --data files (at the same paths) and tokenizer."
                    )
                worker = build_worker(reg.worker, cfg, data.shards, batch_multiple=cfg.procs_per_worker)
                group.place(worker, dev, cfg.procs_per_worker * cfg.data.batch_size)
                if (
                    slowdown[0] != 1.0 or step_s
                ):  # an emulated device; the pause ends early when the run is over
                    slowed(worker, _emulated(step_s, *slowdown), over.wait)
                group.steps_together(worker, over)
                if group.leader:
                    ranks = f" ({group.size} ranks)" if group.size > 1 else ""
                    log(f"joined {server} as worker {reg.worker}{ranks}")
                try:
                    done = _jobs(link, ref, worker, acked, cfg, len(data.shards), acks, over, group)
                except RunOver:
                    done = True
                    if group.leader:
                        log("the server says the run is over; any job in hand is dropped")
                if done:
                    if group.leader:
                        pushes = f"{len(acked)} pushes of this worker were acknowledged"
                        log(f"the run at {server} is done; {pushes}")
                    return 0
            except (KeyboardInterrupt, UserError) as e:  # stopping: tell the server (best effort)
                left = "its group's leader tells the server"
                if group.leader:
                    try:
                        link.stub.Leave(ref, timeout=2.0, metadata=link.meta)
                        left = f"left the run at {server}, which drops its job in hand"
                    except grpc.RpcError:
                        left = f"could not tell {server}, which drops its job when its lease runs out"
                if isinstance(e, KeyboardInterrupt):
                    raise Interrupted(
                        f"worker {reg.worker} stopped by Ctrl-C and {left}; start diloco worker again "
                        "to take its slot."
                    ) from None
                raise
            finally:
                if beat is not None:
                    beat.stop()
            if group.leader:
                log(f"worker {reg.worker}'s lease ran out; joining again as a fresh worker")
    except KeyboardInterrupt:
        raise Interrupted(f"this worker stopped by Ctrl-C before it joined the run at {server}.") from None
    finally:
        if link is not None:
            link.close()
        group.close()


def _register(link: Link, request: pb.RegisterRequest) -> bytes:
    """The server's OK or DONE (serialized), waiting while every slot is taken."""
    while True:
        reg = link.call("registering", lambda: link.stub.Register(request, timeout=30.0, metadata=link.meta))
        if reg.status != pb.RegisterReply.FULL:
            return reg.SerializeToString()
        log(f"every worker slot at {link.server} is taken; waiting for one to free up")
        time.sleep(reg.retry_s)


def _check_job(head: pb.JobChunk, start: list[torch.Tensor] | None, worker: Worker, cfg, shards: int) -> None:
    """A job from the server is checked like any input: steps, shard, position, parameters (none
    for a Streaming DiLoCo job that goes on from the worker's own)."""
    limit = 100 * cfg.inner_steps  # DyLU never gives more than H; a job far beyond it is an error
    ok = (
        1 <= head.steps <= limit
        and 0 <= head.max_steps <= DEADLINE_CAP * limit
        and 0 <= head.shard < shards
        and head.lr_step >= 0
        and head.position >= 0
    )
    ok = ok and math.isfinite(head.lr_stride) and head.lr_stride >= 0
    ok = ok and math.isfinite(head.seconds) and head.seconds >= 0
    want = [(tuple(p.shape), p.dtype) for p in worker.model.parameters()]
    if not ok or (start is not None and [(tuple(t.shape), t.dtype) for t in start] != want):
        raise UserError(
            f"job {head.job} from the server does not fit this run (steps {head.steps}, shard {head.shard}, "
            f"lr step {head.lr_step}, position {head.position}, {len(start or [])} tensors); run the same "
            "diloco on server and workers."
        )


def _first_theta(cfg, download) -> Encoded | None:
    """The run's first θ as the server would send it, built here from the run's settings (the
    seed, or its --init-from file if this machine has that file too); None when it cannot be."""
    try:
        init = load_init(cfg)
    except UserError:  # the file is on the server's machine only: the job brings θ
        return None
    with torch.random.fork_rng(devices=[]):
        model = initial_model(cfg, init)
    return download.encode([p.detach() for p in model.parameters() if p.requires_grad])


def _jobs(
    link: Link | None,
    ref: pb.WorkerRef,
    worker: Worker,
    acked: set[int],
    cfg,
    shards: int,
    acks,
    over: threading.Event,
    group: Group,
) -> bool:
    """Jobs until the run is done (True) or the server no longer knows this worker (False);
    RunOver when the heartbeat hears that the run is over mid-job. The leader talks to the
    server; every rank of a group runs the job."""
    refused = [0]
    download = download_codec(cfg)  # how the server sends θ
    # the θ this worker built from the run's settings, as the server would send it: its first job,
    # if it starts from exactly that (the run's first version), comes without it (WorkerRef.theta)
    built = _first_theta(cfg, download)
    asking = pb.WorkerRef()
    asking.CopyFrom(ref)
    asking.theta = built.digest() if group.leader and built is not None else ""
    while True:
        got: list[bytes] = []

        def ask(got: list[bytes] = got) -> bytes:
            head, blob = link.call(
                "asking for a job", lambda: link.download("GetJob", asking, "a job's parameters"), over
            )
            got.append(blob)
            return head.SerializeToString()

        head = pb.JobChunk.FromString(group.lead(ask))
        if head.status == pb.JobChunk.DONE:
            return True
        if head.status == pb.JobChunk.UNKNOWN_WORKER:
            return False
        if head.status == pb.JobChunk.WAIT:
            time.sleep(head.retry_s)
            continue
        blob = group.share(got[0] if got else None, head.total_bytes)
        if head.own and built is None:
            raise UserError(
                f"job {head.job} from the server came without parameters; run the same diloco on both."
            )
        mine, built, asking.theta = built, None, ""  # from its first job on, θ comes from the server
        # keep: Streaming DiLoCo, its own θ; own: the θ it built (the server checked the digest)
        start = None if head.keep else download.decode(mine if head.own else Encoded.from_bytes(blob))
        _check_job(head, start, worker, cfg, shards)
        if cfg.streaming.on:  # Streaming DiLoCo: the round's segments, pushing fragments
            push = functools.partial(_push, link, over=over, refused=refused, acked=acked, acks=acks)
            if streaming_job(link, ref, worker, head, start, cfg, group, over, push) == "rejoin":
                return False
            continue
        t0 = time.perf_counter()
        stride = head.lr_stride or 1.0  # 0: not set, plain steps
        job = {"lr_step": head.lr_step, "shard": head.shard, "position": head.position, "lr_stride": stride}
        if head.seconds > 0:  # a deadline job: at most its cap (older servers: DEADLINE_CAP × steps)
            most = head.max_steps or DEADLINE_CAP * head.steps
            result = worker.run(start, most, seconds=head.seconds, **job)
        else:
            result = worker.run(start, head.steps, **job)
        compute_s = time.perf_counter() - t0
        message = result.message.to_bytes()
        group.check_same(result.message, head.job)
        push = pb.PushChunk(
            worker=ref.worker,
            run_id=ref.run_id,
            token=ref.token,
            job=head.job,
            steps=result.steps,  # a deadline job's: those it took (the server checks and counts them)
            mean_loss=result.mean_loss,
            last_lr=result.last_lr,
            finite=result.finite,
            compute_s=compute_s,
            total_bytes=len(message),
            version=head.version,
        )
        group.lead(lambda push=push, message=message: _push(link, push, message, over, refused, acked, acks))


def _push(link: Link, push: pb.PushChunk, message: bytes, over, refused: list[int], acked, acks) -> str:
    """Push one job's outer_grad, or a fragment of it (the leader): "acked", "late" or "refused".
    A refused push drops the job; MAX_REFUSED_IN_A_ROW of them stop the worker (UserError)."""
    t0 = time.perf_counter()
    try:
        reply = link.call(
            f"job {push.job}'s update",
            lambda: link.stub.Push(push_chunks(push, message), timeout=120.0, metadata=link.meta),
            over,
        )
    except Refused as e:  # e.g. too stale, or a norm over the bound: this job is dropped
        refused[0] += 1
        if refused[0] >= MAX_REFUSED_IN_A_ROW:
            raise UserError(f"{e} ({refused[0]} updates of this worker were refused in a row)") from None
        log(f"{e} Going on with the next job.")
        return "refused"
    refused[0] = 0
    if reply.status == pb.PushReply.LATE:
        log(f"job {push.job} came too late and was dropped ({reply.reason})")
        return "late"
    acked.add(push.job)  # accepted now, or before (a retry after a lost reply)
    if acks is not None:
        line = {"job": push.job, "push_s": time.perf_counter() - t0}
        if push.fragment:
            line["fragment"] = push.fragment - 1
        with open(acks, "a") as f:
            f.write(json.dumps(line) + "\n")
    return "acked"
