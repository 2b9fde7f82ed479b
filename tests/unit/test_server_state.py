"""The server's shared state without the network: events logged durably then applied in order,
leases renewed and reaped, who may still call, a full disk that stops the run, the status
page's and summary's figures, and a checkpoint plus the log after it restoring the state."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from diloco.config import AsyncConfig, SimConfig
from diloco.core.async_rules import build_async_rule
from diloco.core.codec import Bf16Codec, Encoded
from diloco.core.outer import Nesterov
from diloco.core.outer_side import OuterSide
from diloco.errors import UserError
from diloco.model.gpt import GPT
from diloco.runtime.server import wal
from diloco.runtime.server.security import ServeOptions
from diloco.runtime.server.state import ServerState

NO_TOKEN = ServeOptions(insecure_no_token=True)


def make(tiny, run_dir, *, method="diloco", k=2, opts=NO_TOKEN, **cfg) -> ServerState:
    cfg = tiny(
        method=method,
        num_workers=k,
        runtime="server",
        async_=AsyncConfig(),
        sim=SimConfig(),
        checkpoint_every=1,
        **cfg,
    )
    torch.manual_seed(0)
    rule = Nesterov() if method == "diloco" else build_async_rule("dn", lr=0.7, momentum=0.9, num_workers=k)
    side = OuterSide(GPT(cfg.model), k, update=rule)
    run_dir.mkdir(exist_ok=True)
    return ServerState(cfg, side, [1000] * k, run_dir, opts)


def join(st: ServerState, w: int) -> int:
    """Worker w registers; its registration's token."""
    with st.cond:
        st.record({"kind": "join", "worker": w, "name": f"w{w}", "device": "cpu", "nonce": ""})
        st.renew(w)
        return st.coord.workers[w]["token"]


def events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)


@pytest.mark.timeout(60)
def test_every_event_is_numbered_logged_durably_then_applied_in_order(tiny, tmp_path):
    run_dir = tmp_path / "run"
    st = make(tiny, run_dir)
    tokens = [join(st, w) for w in (0, 1)]
    with st.cond:
        st.record({"kind": "begin", "round": 1, "members": [0, 1]})
    logged = [h for h, _ in wal.read(run_dir / "wal.log")]
    assert [e["seq"] for e in logged] == [1, 2, 3] and [e["kind"] for e in logged] == [
        "join",
        "join",
        "begin",
    ]
    assert events(run_dir) == logged
    assert st.coord.seq == 3 and sorted(st.coord.workers) == [0, 1] and st.coord.members == [0, 1]
    assert tokens == [1, 2]
    st.close()


@pytest.mark.timeout(60)
def test_registrations_that_may_call_are_waited_for_until_told_or_gone(tiny, tmp_path):
    st = make(tiny, tmp_path / "run")
    a, b = join(st, 0), join(st, 1)
    with st.cond:
        assert st.untold() == {a, b}
        st.tell_done(a)
        assert st.untold() == {b}
        st.stop_calling(b)  # it left on its own: nobody to wait for
        assert st.untold() == set()
    st.close()


@pytest.mark.timeout(60)
def test_a_silent_worker_is_reaped_and_a_heard_one_keeps_its_lease(tiny, tmp_path, capsys):
    run_dir = tmp_path / "run"
    st = make(tiny, run_dir, worker_timeout_s=0.05)
    join(st, 0)
    b = join(st, 1)
    with st.cond:
        st.cond.wait(0.1)
        assert st.touch(1, b) and not st.touch(0, b)  # another registration's token renews nothing
        st.reap()
    assert sorted(st.coord.workers) == [1]
    last = events(run_dir)[-1]
    assert (last["kind"], last["worker"], last["reason"]) == ("leave", 0, "expired")
    assert "worker 0 (w0) was silent for 0 s: it is gone, its job is re-offered" in capsys.readouterr().err
    with st.cond:
        st.leave(1, "left")
    assert st.coord.workers == {} and events(run_dir)[-1]["reason"] == "left"
    assert "worker 1 (w1) left the run (it said it stops)" in capsys.readouterr().err
    st.close()


@pytest.mark.timeout(60)
def test_a_log_that_cannot_be_written_stops_the_run_with_a_sentence(tiny, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    st = make(tiny, run_dir)

    def full(header, payload=b"", spool=None, *, sync=True):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st.wal, "append", full)
    with (
        st.cond,
        pytest.raises(
            UserError, match=r"cannot write the write-ahead log \S+wal.log \(No space left on device\)"
        ),
    ):
        st.record({"kind": "join", "worker": 0, "name": "w0", "device": "cpu"})
    assert st.coord.seq == 0 and not (run_dir / "events.jsonl").read_text()  # nothing applied
    with pytest.raises(UserError, match=f"continue with: diloco serve --resume {run_dir}"):
        st.raise_failure()
    st.close()


@pytest.mark.timeout(60)
def test_a_log_that_cannot_be_made_durable_after_the_lock_stops_the_run(tiny, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    st = make(tiny, run_dir)
    with st.cond:  # a push's record: written under the lock, made durable after it
        st.record({"kind": "join", "worker": 0, "name": "w0", "device": "cpu", "nonce": ""}, sync=False)
    end = st.logged_to

    def failing(to):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(st.wal, "sync_to", failing)
    with pytest.raises(
        UserError, match=r"cannot write the write-ahead log \S+wal.log \(Input/output error\)"
    ):
        st.make_durable(end)  # the push is not acknowledged; the run stops
    with pytest.raises(UserError, match="continue with: diloco serve --resume"):
        st.raise_failure()
    monkeypatch.undo()
    st.close()


@pytest.mark.timeout(60)
def test_status_and_summary_count_each_workers_traffic(tiny, tmp_path):
    st = make(tiny, tmp_path / "run", method="async")
    join(st, 0)
    join(st, 1)
    with st.cond:
        st.count_sent(1, 300)
        st.count_received(1, 500)
        st.push_took(0.25)
        st.push_took(0.125)
        summary = st.summary()
    status = st.status()
    assert (
        status["k"] == 2
        and not status["auth"]
        and not status["tls"]
        and status["push_seconds"] == [0.125, 0.25]
    )
    rows = {w["worker"]: w for w in status["workers"]}
    assert rows[0]["state"] == "idle" and rows[0]["host"] == "w0" and rows[0]["bytes_sent"] == 0
    assert (rows[1]["bytes_sent"], rows[1]["bytes_received"]) == (300, 500)
    assert summary["events"] == 2
    assert [(r["wire_bytes_sent"], r["wire_bytes_received"]) for r in summary["workers"]] == [
        (0, 0),
        (300, 500),
    ]
    st.close()


@pytest.mark.timeout(60)
def test_a_checkpoint_and_the_log_after_it_restore_the_state(tiny, tmp_path):
    """The checkpoint's "server" entry, then the log's later records replayed: the coordinator and
    events.jsonl are as they were; a checkpoint two later ones hold lets the log drop them."""
    run_dir = tmp_path / "run"
    st = make(tiny, run_dir, method="async")
    join(st, 0)
    join(st, 1)
    with st.cond:
        st.count_sent(0, 7)
        saved = json.loads(json.dumps(st.state_dict()))  # as a checkpoint holds it
        st.record(st.coord.plan_dispatch(0))
        st.leave(1, "left")
    lines = (run_dir / "events.jsonl").read_text()
    st.close()

    again = make(tiny, run_dir, method="async")
    again.load_state_dict(saved)
    assert again.replaying and again.run_id == st.run_id and again.coord.seq == 2
    assert again.replay_next() is None and not again.replaying  # neither event returns anything
    assert (run_dir / "events.jsonl").read_text() == lines
    assert again.coord.seq == 4 and sorted(again.coord.workers) == [0] and len(again.coord.jobs) == 1
    with again.cond:
        assert again.summary()["workers"][0]["wire_bytes_sent"] == 7
        again.state_dict()  # a checkpoint at event 4 ...
        again.state_dict()  # ... and another: the log's records up to event 4 may go
    again.after_checkpoint()
    assert wal.read(run_dir / "wal.log") == []
    again.close()


@pytest.mark.timeout(60)
def test_a_logged_push_is_replayed_from_its_file_and_a_missing_file_is_one_sentence(tiny, tmp_path):
    """A push's bytes are in its own file (wal.Spool), not in the log: a resumed server reads the
    message back from it, the same values; with the file gone it says which and stops."""
    run_dir = tmp_path / "run"
    st = make(tiny, run_dir, method="async")
    join(st, 0)
    grads = [torch.full_like(p, 1e-3) for p in st.side.params]
    blob = st.side.codec.encode(grads, {}).to_bytes()
    with st.cond:
        saved = json.loads(json.dumps(st.state_dict()))
        job = st.record(st.coord.plan_dispatch(0)) or st.coord.workers[0]["job"]
    spool = st.wal.spool(f"job{job}")
    spool.write(blob)
    message = Encoded.from_bytes(spool.finish())
    push = {"kind": "push", "job": job, "worker": 0, "steps": st.coord.jobs[job].steps, "loss": 1.0}
    push |= {"lr": 1e-3, "compute_s": 0.1, "finite": True, "nbytes": message.nbytes, "norm": None}
    with st.cond:
        st.record(push, message=message, spool=spool)
    st.close()
    (logged,) = [h for h, _ in wal.read(run_dir / "wal.log") if h["kind"] == "push"]
    assert (run_dir / "pushes" / logged["file"]).read_bytes() == blob

    again = make(tiny, run_dir, method="async")
    again.load_state_dict(saved)
    while again.replaying:
        again.replay_next()
    ((_, replayed, _),) = again.coord.arrived
    assert replayed.digest() == message.digest()
    again.close()

    (run_dir / "pushes" / logged["file"]).unlink()
    again = make(tiny, run_dir, method="async")
    again.load_state_dict(saved)
    with pytest.raises(UserError, match=f"names the push file \\S+{logged['file']}, which is missing"):
        while again.replaying:
            again.replay_next()
    again.close()


@pytest.mark.timeout(60)
def test_a_log_that_does_not_go_on_from_the_checkpoint_is_refused(tiny, tmp_path):
    run_dir = tmp_path / "run"
    st = make(tiny, run_dir, method="async")
    join(st, 0)
    with st.cond:
        old = st.state_dict()  # event 1
        join(st, 1)
        st.state_dict()  # event 2
        st.state_dict()
    st.after_checkpoint()  # the log keeps events after 2
    with st.cond:
        st.leave(1, "left")
    st.close()
    again = make(tiny, run_dir, method="async")
    with pytest.raises(
        UserError, match="goes on from event 3, but the checkpoint it resumes from ends at event 1"
    ):
        again.load_state_dict(old)
    again.close()


@pytest.mark.timeout(60)
def test_a_first_job_goes_without_theta_only_to_a_worker_that_built_the_same(tiny, tmp_path):
    """WorkerRef.theta: the digest of the θ a worker built from the run's settings. Its job of
    the run's first version goes without θ only if the digest is that θ's, as sent."""
    st = make(tiny, tmp_path / "run")
    join(st, 0)
    with st.cond:
        st.record({"kind": "begin", "round": 1, "members": [0]})
        st.record(st.coord.plan_dispatch(0, time.time()))
    job = st.coord.jobs[0]
    same = st.side.download.encode([p.detach().clone() for p in st.side.params]).digest()
    other = [p.detach().clone() for p in st.side.params]
    other[0][0] += 1e-6
    assert st.own_theta(job, same)
    assert not st.own_theta(job, st.side.download.encode(other).digest())
    assert not st.own_theta(job, "")  # a worker that built none (its --init-from file is elsewhere)
    assert not st.own_theta(dataclasses.replace(job, version=1), same)  # later versions: sent
    st.close()


@pytest.mark.timeout(60)
def test_a_job_waits_while_theta_is_being_sent_for_as_many_downloads_as_allowed(tiny, tmp_path):
    """--max-inflight-downloads 1: while worker 1's version-0 θ is being sent, no job from
    version 1 (a second copy of θ) is handed out; once it went out, one is, and the wait counts."""
    st = make(tiny, tmp_path / "run", method="async", max_inflight_downloads=1)
    join(st, 0)
    join(st, 1)
    with st.cond:
        for w in (0, 1):
            st.record(st.coord.plan_dispatch(w, time.time()))
        sent = st.coord.jobs[st.coord.workers[1]["job"]]
        st.streaming.add(sent.job)  # what GetJob does while it sends θ
        st.side.version += 1  # an update applied since
        assert not st.may_hand_out()
        held = [j.worker for j in st.coord.jobs.values() if j.pulled is not None]
        assert held == [1]  # worker 0's job, whose download had not begun, let its θ go
        st.streaming.discard(sent.job)  # GetJob's end ...
    time.sleep(0.05)
    st.downloaded(sent)  # ... and θ went out whole
    with st.cond:
        assert st.may_hand_out() and st.downloads["waited_s"] >= 0.05
    st.close()


@pytest.mark.timeout(60)
def test_workers_asking_for_a_version_together_share_one_encoding(tiny, tmp_path):
    """Eight GetJobs of the same new version at once: θ is encoded for download once, and all
    eight stream that one message (each encoding its own held 16 × 0.5 GB at once at 150m). The
    encoder is the real one, slowed so that without the lock the eight would overlap."""
    st = make(tiny, tmp_path / "run", method="async", k=8)
    for w in range(8):
        join(st, w)
    with st.cond:
        for w in range(8):
            st.record(st.coord.plan_dispatch(w, time.time()))
        jobs = [(job, job.pulled) for job in st.coord.jobs.values()]
    assert {job.version for job, _ in jobs} == {0}
    encode, made = st.side.download.encode, []

    def slow_encode(tensors):
        made.append(threading.get_ident())
        time.sleep(0.2)
        return encode(tensors)

    st.side.download.encode = slow_encode
    barrier = threading.Barrier(len(jobs))

    def ask(job, pulled):
        barrier.wait()
        return st._version_message(job.version, pulled)

    with ThreadPoolExecutor(len(jobs)) as pool:
        messages = list(pool.map(lambda jp: ask(*jp), jobs))
    assert len(made) == 1
    assert all(m is messages[0] for m in messages)
    length, pieces = st.params_stream(jobs[0][0], jobs[0][1])  # a later job of it: no new encoding
    assert len(made) == 1 and length == sum(len(p) for p in pieces)
    st.close()


@pytest.mark.timeout(60)
def test_a_bf16_download_keeps_theta_as_its_message_and_reads_older_checkpoints(tiny, tmp_path):
    """Through a lossy download codec a job's θ is held as the message workers receive (half of
    θ), decoded only where float32 is needed; a checkpoint from before, which holds that θ in
    float32, is encoded again to the same payload."""
    st = make(tiny, tmp_path / "run", method="async")
    st.side.download = Bf16Codec()
    join(st, 0)
    with st.cond:
        st.record(st.coord.plan_dispatch(0))
    (job,) = st.coord.jobs.values()
    want = Bf16Codec().encode(st.side.params)
    assert [p.dtype for p in job.pulled] == [torch.bfloat16] * len(st.side.params)
    assert st.coord.download_message(job.pulled).digest() == want.digest()
    received = st.side.through_download(st.side.params)  # what the worker decodes
    assert all(torch.equal(a, b) for a, b in zip(st.coord.theta_of(job.pulled), received, strict=True))
    stored = st.coord.stored_pulls(received)
    assert all(torch.equal(a, b) for a, b in zip(stored, want.payload, strict=True))
    st.close()
