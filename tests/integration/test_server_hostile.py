"""Hostile input against a real parameter server: gRPC on loopback, every push built by hand.

The server runs in this process (its gRPC service and its main loop on a thread, as `diloco
serve` runs them) so the test can hash its global parameters: each malformed, foreign, replayed,
stale or harmful push must be refused with its reason and leave θ and the version exactly as
they were, counted as a `rejected` metrics line and a `reject` event."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
import uuid

import grpc
import pytest
import torch

from diloco.config import AsyncConfig, DyluConfig, SimConfig
from diloco.core.codec import Fp32Codec
from diloco.data.recipe import prepare_data
from diloco.run.assemble import build_trainer
from diloco.run.loop import Run
from diloco.rundir.metrics import MetricsWriter, read_metrics
from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server import diloco_pb2_grpc as rpc
from diloco.runtime.server.handlers import CHUNK_BYTES, PROTOCOL
from diloco.runtime.server.security import ServeOptions
from diloco.runtime.server.wire import push_chunks

TOKEN = "hostile-suite-token-0123456789"


class Client:
    """A worker written by hand: registers, takes jobs, pushes whatever the test builds."""

    def __init__(self, address: str, token: str | None = TOKEN):
        self.channel = grpc.insecure_channel(address)
        self.stub = rpc.ParameterServerStub(self.channel)
        self.meta = (("authorization", f"Bearer {token}"),) if token else ()

    def register(self) -> Client:
        request = pb.RegisterRequest(name="hand", device="cpu", protocol=PROTOCOL, nonce=uuid.uuid4().hex)
        reg = self.stub.Register(request, timeout=10, metadata=self.meta)
        assert reg.status == pb.RegisterReply.OK
        self.ref = pb.WorkerRef(worker=reg.worker, run_id=reg.run_id, token=reg.token)
        return self

    def job(self) -> pb.JobChunk:
        while True:
            chunks = self.stub.GetJob(self.ref, timeout=30, metadata=self.meta)
            head = next(chunks)
            list(chunks)
            if head.status == pb.JobChunk.RUN:
                return head
            assert head.status == pb.JobChunk.WAIT, head

    def push(self, head: pb.JobChunk, blob: bytes, **fields) -> pb.PushReply:
        values = dict(
            worker=self.ref.worker,
            run_id=self.ref.run_id,
            token=self.ref.token,
            job=head.job,
            steps=head.steps,
            mean_loss=3.0,
            last_lr=1e-3,
            finite=True,
            compute_s=0.01,
            total_bytes=len(blob),
            version=head.version,
        )
        values.update(fields)
        return self.stub.Push(push_chunks(pb.PushChunk(**values), blob), timeout=30, metadata=self.meta)


@pytest.fixture
def server(tmp_path):
    yield from _serving(tmp_path)


@pytest.fixture
def topk_server(tmp_path):
    yield from _serving(tmp_path, codec="topk", topk_fraction=0.25)


@pytest.fixture
def chunked_topk_server(tmp_path):  # SparseLoCo's message layout
    yield from _serving(tmp_path, codec="topk", topk_fraction=0.25, topk_chunk=64, topk_bits=2)


def _serving(tmp_path, **overrides):
    """An async server with its main loop on a thread, on loopback; `overrides` of its config."""
    cfg = dataclasses.replace(
        __import__("conftest").tiny_config(tmp_path),
        runtime="server",
        method="async",
        rounds=100,
        checkpoint_every=1,
        eval_every=10_000,
        max_staleness=2,
        max_update_norm_ratio=5.0,
        sim=SimConfig(),
        async_=AsyncConfig(rule="naive", shard_sampling=False, grace_s=0.0),
        dylu=DyluConfig(enabled=False),
        **overrides,
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = prepare_data(cfg)
    (tmp_path / "token").write_text(TOKEN)
    opts = ServeOptions("127.0.0.1:0", token_file=tmp_path / "token", http_port=-1)
    rt = build_trainer(cfg, data, run_dir=run_dir, serve=opts)
    rt.attach_run(Run(cfg, rt, data, MetricsWriter(run_dir)))
    errors: list[BaseException] = []

    def main_loop():  # what run/loop.py does with the runtime: step until the budget is spent
        try:
            while rt.step() is not None:
                pass
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=main_loop, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while rt.address is None and time.time() < deadline:
        time.sleep(0.05)
    yield rt
    with rt.cond:
        rt.failure = RuntimeError("the test is over")
        rt.cond.notify_all()
    thread.join(10)
    rt.run.writer.close()
    rt.close(clean=False)
    assert [str(e) for e in errors] == ["the test is over"]


def state(rt) -> tuple[str, int]:
    """The global parameters' hash and version."""
    with rt.cond:
        h = hashlib.sha256()
        for p in rt.side.params:
            h.update(p.detach().numpy().tobytes())
        return h.hexdigest(), rt.side.version


def update(rt, scale: float = 1e-3, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(p.shape, generator=g).to(dtype) for p in rt.side.params]


def encode(tensors) -> bytes:
    return Fp32Codec().encode(tensors).to_bytes()


def applied(rt, version: int) -> None:
    deadline = time.time() + 30
    while state(rt)[1] < version:
        assert time.time() < deadline, f"version {version} never came"
        time.sleep(0.02)


def refused(rt, call, code: grpc.StatusCode, reason: str) -> None:
    """`call` is refused with `code` and `reason`, and θ and the version do not move."""
    before = state(rt)
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, (e.value.code(), e.value.details())
    assert e.value.details().startswith(reason) or reason in e.value.details(), e.value.details()
    time.sleep(0.05)  # anything it set off would have happened by now
    assert state(rt) == before


@pytest.mark.timeout(120)
def test_every_hostile_push_is_refused_with_its_reason_and_changes_nothing(server):
    rt = server
    a, b = Client(rt.address).register(), Client(rt.address).register()
    ja, jb = a.job(), b.job()
    honest = encode(update(rt))
    INVALID, DENIED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED

    # no token, a wrong token: refused before any handler; no join is logged
    joins = len([e for e in _events(rt) if e["kind"] == "join"])
    for token in (None, "not-the-token-of-this-run"):
        intruder = Client(rt.address, token)
        request = pb.RegisterRequest(name="x", device="cpu", protocol=PROTOCOL)
        refused(
            rt,
            lambda i=intruder, r=request: i.stub.Register(r, timeout=10, metadata=i.meta),
            grpc.StatusCode.UNAUTHENTICATED,
            "this server needs the run's token",
        )
        intruder.ref = a.ref
        refused(rt, lambda i=intruder: i.push(ja, honest), grpc.StatusCode.UNAUTHENTICATED, "this server")
    assert len([e for e in _events(rt) if e["kind"] == "join"]) == joins
    assert rt.refusals.count == 4

    # the pusher's own job, malformed in every way the header or the bytes can be
    huge = encode(update(rt)) + b"\0" * (rt.max_message_bytes + 1 - len(honest))
    nan, inf = update(rt), update(rt)
    nan[0].view(-1)[0], inf[-1].view(-1)[-1] = float("nan"), float("inf")
    bad_shape = update(rt)
    bad_shape[0] = bad_shape[0][:-1]
    own_job_cases = [
        ("oversized", dict(total_bytes=10**9), honest, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("oversized", dict(total_bytes=len(honest)), huge, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("length", dict(total_bytes=len(honest) + 1), honest, INVALID),
        ("version", dict(version=ja.version + 1), honest, INVALID),
        ("steps", dict(steps=ja.steps + 1), honest, INVALID),
        ("malformed", {}, b"garbage, not a message" * 10, INVALID),
        ("shape", {}, encode(bad_shape), INVALID),
        ("shape", {}, encode(update(rt, dtype=torch.float16)), INVALID),
        ("nonfinite", {}, encode(nan), INVALID),
        ("nonfinite", {}, encode(inf), INVALID),
    ]
    for reason, fields, blob, code in own_job_cases:
        refused(rt, lambda ja=ja, blob=blob, fields=fields: a.push(ja, blob, **fields), code, reason)
        ja = a.job()  # the refused job was given back; the worker gets a new one
    assert len(huge) > CHUNK_BYTES or rt.max_message_bytes < CHUNK_BYTES

    # someone else's job, a job never handed out
    refused(rt, lambda: b.push(ja, honest, worker=b.ref.worker), DENIED, "not_yours")
    refused(rt, lambda: a.push(ja, honest, job=10**6), INVALID, "unknown_job")

    # honest pushes are accepted; a retry is a harmless duplicate, a replay by another is refused
    version = state(rt)[1]
    assert a.push(ja, honest).status == pb.PushReply.ACCEPTED
    applied(rt, version + 1)
    before = state(rt)
    assert a.push(ja, honest).status == pb.PushReply.DUPLICATE
    assert state(rt) == before
    refused(rt, lambda: b.push(ja, honest, worker=b.ref.worker), DENIED, "replay")

    # a stale push: b's job was pulled at version 0; three updates later it is past the limit 2
    for seed in range(2):
        ja = a.job()
        version = state(rt)[1]
        assert a.push(ja, encode(update(rt, seed=seed + 1))).status == pb.PushReply.ACCEPTED
        applied(rt, version + 1)
    assert state(rt)[1] - jb.version == 3
    refused(rt, lambda: b.push(jb, honest), grpc.StatusCode.FAILED_PRECONDITION, "stale")

    # a norm far above the recent ones (the bound needs 4 accepted pushes to compare with)
    for seed in range(2):
        ja = a.job()
        version = state(rt)[1]
        assert a.push(ja, encode(update(rt, seed=seed + 10))).status == pb.PushReply.ACCEPTED
        applied(rt, version + 1)
    ja = a.job()
    refused(rt, lambda: a.push(ja, encode(update(rt, scale=1.0))), INVALID, "norm")
    ja = a.job()
    assert a.push(ja, encode(update(rt, seed=20))).status == pb.PushReply.ACCEPTED  # the bound lets it in

    expected = {
        "oversized": 2,
        "length": 1,
        "version": 1,
        "steps": 1,
        "malformed": 1,
        "shape": 2,
        "nonfinite": 2,
        "not_yours": 1,
        "unknown_job": 1,
        "replay": 1,
        "stale": 1,
        "norm": 1,
    }
    with rt.cond:
        assert rt.coord.rejected == expected
    rejects = [e for e in _events(rt) if e["kind"] == "reject"]
    foreign = [e["abandon"] for e in rejects if e["reason"] in ("not_yours", "replay", "unknown_job")]
    assert foreign == [False] * 3  # nobody else's job was given back
    rt.run.writer.flush()  # its lines are written by the writer's thread
    lines = [m for m in read_metrics(rt.run_dir) if m["kind"] == "rejected"]
    counts: dict[str, int] = {}
    for m in lines:
        counts[m["reason"]] = counts.get(m["reason"], 0) + 1
        assert m["detail"] and "version" in m and "wall_time_s" in m
    assert counts == expected


def _events(rt) -> list[dict]:
    with rt.cond:
        rt.state.sync_events()
    with open(rt.run_dir / "events.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(60)
def test_a_topk_push_with_bad_indices_is_refused_as_malformed(topk_server):
    """Shapes, dtypes and meta right, indices out of order or out of range: refused before θ."""
    rt = topk_server
    a = Client(rt.address).register()
    codec = rt.side.codec
    for damage in ("unsorted", "out of range"):
        job = a.job()  # a refused push of one's own job gives it back: the next one is new
        message = codec.encode(update(rt), None)
        index = message.payload[1]
        if damage == "unsorted":
            index[0], index[1] = index[1].clone(), index[0].clone()
        else:
            index[-1] = 10**6
        refused(
            rt,
            lambda m=message, j=job: a.push(j, m.to_bytes()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "malformed",
        )
    rejects = [e for e in _events(rt) if e["kind"] == "reject"]
    assert [e["reason"] for e in rejects] == ["malformed", "malformed"]


@pytest.mark.timeout(60)
def test_a_chunked_topk_push_with_bad_offsets_sizes_or_bounds_is_refused_as_malformed(chunked_topk_server):
    """Offsets repeated within a chunk and a negative bound are refused before θ as "malformed";
    codes a byte short, or another chunk size in the header, do not have the run's message shapes
    ("shape")."""
    rt = chunked_topk_server
    a = Client(rt.address).register()
    codec = rt.side.codec
    harms = {
        "malformed": lambda m: m.payload.__setitem__(1, torch.zeros_like(m.payload[1])),
        "shape": lambda m: m.payload.__setitem__(0, m.payload[0][:-1]),
        "malformed ": lambda m: m.payload.__setitem__(2, -m.payload[2].abs() - 1),
        "shape ": lambda m: m.meta.__setitem__("chunk", 128),
    }
    for reason, harm in harms.items():
        job = a.job()
        message = codec.encode(update(rt), None)
        harm(message)
        refused(
            rt,
            lambda m=message, j=job: a.push(j, m.to_bytes()),
            grpc.StatusCode.INVALID_ARGUMENT,
            reason.strip(),
        )
    rejects = [e for e in _events(rt) if e["kind"] == "reject"]
    assert [e["reason"] for e in rejects] == [r.strip() for r in harms]


@pytest.mark.timeout(120)
def test_a_job_asked_for_again_after_its_parameters_went_out_is_given_back(server):
    """An async job's θ is let go once it went out whole (the server holds θ per version only
    while a download needs it): a worker that asks for the same job again gets a new one, and
    a push of the old one is late, not applied."""
    rt = server
    a = Client(rt.address).register()
    first = a.job()  # θ read whole
    with rt.cond:
        assert rt.state.coord.jobs[first.job].pulled is None and not rt.state._messages
    again = a.job()  # asked for again (a worker that lost what it got)
    assert again.job != first.job and again.total_bytes == first.total_bytes > 0
    assert a.push(first, encode(update(rt))).status == pb.PushReply.LATE
    assert a.push(again, encode(update(rt))).status == pb.PushReply.ACCEPTED
    applied(rt, 1)
    kinds = [(e["kind"], e.get("job")) for e in _events(rt) if e["kind"] in ("regive", "late", "push")]
    assert kinds == [("regive", first.job), ("push", again.job)]


@pytest.fixture
def one_download_server(tmp_path):
    yield from _serving(tmp_path, max_inflight_downloads=1)  # the default


@pytest.mark.timeout(120)
def test_a_job_whose_download_has_not_begun_holds_no_one_up(one_download_server):
    """--max-inflight-downloads 1 (the default): worker b's version-0 job is never fetched (a
    worker slow to ask, or gone until its lease runs out); a's next job, from version 1, is
    handed out at once: b's θ is let go, and b, asking at last, is given a new job."""
    rt = one_download_server
    a, b = Client(rt.address).register(), Client(rt.address).register()
    first = a.job()
    with rt.cond:
        stale = rt.state.coord.workers[b.ref.worker]["job"]
    assert a.push(first, encode(update(rt))).status == pb.PushReply.ACCEPTED
    applied(rt, 1)
    assert a.job().version == 1
    late = b.job()
    assert late.job != stale and late.version == 1
    assert ("regive", stale) in [(e["kind"], e.get("job")) for e in _events(rt)]
