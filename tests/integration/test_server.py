"""The parameter server for real: `diloco serve` and `diloco worker` processes talking gRPC on
loopback, compared with the simulator and with `diloco replay` (its own re-run of the log)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
from conftest import check_summary, user_files

from diloco.cli.main import main
from diloco.run.replay import replay

TINY = "[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n"
TOKEN = "test-token-of-this-run-0123456789"
# server and workers share the run's token through the environment, as a deployment would
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DILOCO_TOKEN": TOKEN}
SMALL = ["--seq-len", "32", "--batch-size", "4", "--threads", "1"]


def free_port() -> int:
    """A free port whose successor is free too, for the tests that keep the status page's
    default port (--port + 1); serve() gives the others any free one."""
    while True:
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                t.bind(("127.0.0.1", port + 1))
            except (OSError, OverflowError):
                continue
            return port


# run dir -> the server last started on it, so that address() waits for that one and fails fast
SERVERS: weakref.WeakValueDictionary[Path, subprocess.Popen] = weakref.WeakValueDictionary()


def serve(
    tmp: Path,
    *args: str,
    port: int = 0,
    out: str = "run",
    env=None,
    toml: str = TINY,
    http_port: int | None = 0,
) -> subprocess.Popen:
    """`diloco serve` on `port`; its status page on any free port unless `http_port` is None
    (the default, --port + 1: a port an outgoing connection may hold by then) or args name one."""
    (tmp / "tiny.toml").write_text(toml)
    cmd = [sys.executable, "-m", "diloco", "serve", "--port", str(port), *args]
    if "--resume" not in args:
        cmd += ["--config", str(tmp / "tiny.toml"), *SMALL, "--out", str(tmp / out)]
    if http_port is not None and "--http-port" not in args:
        cmd += ["--http-port", str(http_port)]
    run_dir = Path(args[args.index("--resume") + 1]) if "--resume" in args else tmp / out
    proc = subprocess.Popen(cmd, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    SERVERS[run_dir] = proc
    return proc


def worker(address: str, *args: str, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diloco", "worker", "--server", address, "--threads", "1", *args]
    return subprocess.Popen(cmd, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def address(run_dir: Path, timeout: float = 60.0) -> str:
    """The address in server.json, once the server serve() last started there has written it
    (a resumed server's folder holds its predecessor's); fails at once if that server exited."""
    srv = SERVERS.get(run_dir)
    deadline = time.time() + timeout
    while time.time() < deadline:
        exited = srv is not None and srv.poll() is not None
        try:
            served = json.loads((run_dir / "server.json").read_text())
            if srv is None or served["pid"] == srv.pid:
                return served["address"]
        except (OSError, ValueError):
            pass
        if exited:  # read once more after it exited: it may have written the file, then ended
            raise AssertionError(f"the server exited {srv.returncode}: {srv.communicate()[1]}")
        time.sleep(0.1)
    raise AssertionError(f"the server never wrote {run_dir / 'server.json'}")


def events(run_dir: Path) -> list[dict]:
    try:
        with open(run_dir / "events.jsonl") as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except OSError:
        return []


def wait_for(predicate, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def finish(*procs: subprocess.Popen, timeout: float = 120.0) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out.append((p.returncode, err))
    return out


def slot_of(run_dir: Path, proc: subprocess.Popen) -> int | None:
    """The slot the worker process `proc` last joined, None before it has."""
    joins = [e for e in events(run_dir) if e["kind"] == "join" and e["name"].endswith(f":{proc.pid}")]
    return joins[-1]["worker"] if joins else None


@pytest.mark.timeout(180)
def test_sync_server_equals_the_simulator_and_replays(tmp_path):
    """Two workers, one started before the server: the server's global parameters equal `diloco
    train` in the simulator for the same seed, bit for bit, and so does `diloco replay`."""
    port = free_port()
    early = worker(f"127.0.0.1:{port}")  # retries until the server is up
    assert "does not answer" in early.stderr.readline()
    run = ["--workers", "2", "--inner-steps", "4", "--rounds", "3"]
    srv = serve(tmp_path, *run, port=port)
    late = worker(address(tmp_path / "run"))
    results = finish(srv, early, late)
    assert [rc for rc, _ in results] == [0, 0, 0], results

    (tmp_path / "sim.toml").write_text(TINY)
    cmd = ["train", "--config", str(tmp_path / "sim.toml"), *SMALL, *run, "--procs", "1"]
    assert main([*cmd, "--out", str(tmp_path / "sim")]) == 0
    server_model = (tmp_path / "run" / "model.safetensors").read_bytes()
    assert server_model == (tmp_path / "sim" / "model.safetensors").read_bytes()

    assert replay(tmp_path / "run")["bitwise_equal"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["runtime"] == "server" and summary["outer_updates"] == 3
    assert [w["jobs"] for w in summary["workers"]] == [3, 3]
    slots = summary["push_slots"]  # --max-inflight-pushes 0: from the memory available, ≥ 1
    assert slots["limit"] >= 1 and 1 <= slots["most_at_once"] <= min(2, slots["limit"])
    assert all(w["wire_bytes_sent"] > 0 and w["compute_utilisation"] > 0 for w in summary["workers"])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((x["inner_step"], x["worker"]) for x in lines if x["kind"] == "inner") == [
        (s, w) for s in (4, 8, 12) for w in (0, 1)
    ]


@pytest.mark.slow  # the suite's 10 minutes: test_push_slots.py tests the slots, the sync test the run
@pytest.mark.timeout(180)
def test_pushes_beyond_the_inflight_limit_wait_their_turn(tmp_path):
    """--max-inflight-pushes 1 with 3 workers pushing at each round's end: never more than one
    push received at once, none refused for it, and the run is the simulator's bit for bit."""
    run = ["--workers", "3", "--inner-steps", "4", "--rounds", "3"]
    srv = serve(tmp_path, *run, "--max-inflight-pushes", "1")
    results = finish(srv, *[worker(address(tmp_path / "run")) for _ in range(3)])
    assert [rc for rc, _ in results] == [0, 0, 0, 0], results
    assert "receiving at most 1 pushes at once" in results[0][1]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["push_slots"]["limit"] == 1 and summary["push_slots"]["most_at_once"] == 1
    assert summary["outer_updates"] == 3 and not [
        e for e in events(tmp_path / "run") if e["kind"] == "reject"
    ]
    (tmp_path / "sim.toml").write_text(TINY)
    cmd = ["train", "--config", str(tmp_path / "sim.toml"), *SMALL, *run, "--procs", "1"]
    assert main([*cmd, "--out", str(tmp_path / "sim")]) == 0
    server_model = (tmp_path / "run" / "model.safetensors").read_bytes()
    assert server_model == (tmp_path / "sim" / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "codec",
    [
        pytest.param(  # the suite's 10 minutes: test_server_streaming.py runs these flags by default
            ["--codec", "fp4", "--error-feedback", "--download-codec", "bf16"], marks=pytest.mark.slow
        ),
        ["--method", "async", "--codec", "topk", "--topk-fraction", "0.2", "--error-feedback"]
        + ["--topk-chunk", "64", "--topk-bits", "3"]  # per chunk, 3-bit values: validated as pushed
        + ["--download-codec", "bf16"],  # the server keeps θ per version as bf16; replay decodes it
        ["--outer-opt", "sparseloco", "--topk-fraction", "0.2", "--topk-chunk", "64", "--outer-lr", "1.0"],
    ],
    ids=["sync-fp4-bf16-download", "async-chunked-topk-bf16-download", "sync-sparseloco"],
)
def test_compressed_messages_through_the_server_equal_the_simulator_and_replay(tmp_path, codec):
    """Workers push encoded outer_grads (with their own error feedback) and download θ through
    the download codec; sync equals the simulator bit for bit, and both replay."""
    run = ["--workers", "2", "--inner-steps", "4", "--rounds", "3", *codec]
    srv = serve(tmp_path, *run, "--checkpoint-every", "1")
    workers = [worker(address(tmp_path / "run")) for _ in range(2)]
    results = finish(srv, *workers)
    assert [rc for rc, _ in results] == [0, 0, 0], results
    assert replay(tmp_path / "run")["bitwise_equal"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    params = summary["params"]
    if "async" not in codec:
        (tmp_path / "sim.toml").write_text(TINY)
        cmd = ["train", "--config", str(tmp_path / "sim.toml"), *SMALL, *run, "--procs", "1"]
        assert main([*cmd, "--out", str(tmp_path / "sim")]) == 0
        server_model = (tmp_path / "run" / "model.safetensors").read_bytes()
        assert server_model == (tmp_path / "sim" / "model.safetensors").read_bytes()
        # 3 pushes of 4-bit codes with a scale per 256 values; 3 downloads of bf16
        assert summary["bytes_sent_per_worker"] < 3 * params * 0.6
    # what crossed the wire: pushes far smaller than float32 θ, downloads of 2 or 4-byte values,
    # none for a first job from the θ each worker built itself (sync: both start from version 0;
    # async: a worker whose first job came after an update downloads it)
    # (each download a little over params × down bytes: the message's own header and per-tensor
    # fields, 2.86% at this tiny model's size, so the bound grows with the downloads: async runs
    # hand out 3 to 5 jobs a worker, as timing goes)
    down = 2 if "bf16" in codec else 4
    for w in summary["workers"]:
        assert w["wire_bytes_sent"] < w["jobs"] * params * 4 * 0.5
        pulls = w["wire_bytes_received"] / (params * down)
        assert any(
            n <= pulls <= 1.1 * n
            for n in ([w["jobs"] - 1, w["jobs"]] if "async" in codec else [w["jobs"] - 1])
        ), (w["jobs"], pulls)


@pytest.mark.timeout(180)
def test_async_worker_joins_and_one_is_killed_mid_job(tmp_path):
    """Async: a third worker joins mid-run and one is killed in the middle of a job; its lease
    runs out, its job is re-offered, the compute budget is met, and the log replays bit for bit."""
    run = ["--method", "async", "--workers", "3", "--inner-steps", "10", "--rounds", "8"]
    srv = serve(tmp_path, *run, "--worker-timeout-s", "2")
    run_dir = tmp_path / "run"
    addr = address(run_dir)
    first, doomed = worker(addr, "--slowdown", "8"), worker(addr, "--slowdown", "8")
    wait_for(lambda: sum(e["kind"] == "push" for e in events(run_dir)) >= 4, what="four pushes")
    joiner = worker(addr, "--slowdown", "8")
    slot = slot_of(run_dir, doomed)

    def doomed_is_mid_job() -> bool:
        mine = [e for e in events(run_dir) if e.get("worker") == slot and e["kind"] in ("dispatch", "push")]
        return bool(mine) and mine[-1]["kind"] == "dispatch" and mine[-1]["steps"] > 1

    wait_for(doomed_is_mid_job, what="the doomed worker mid-job")
    doomed.send_signal(signal.SIGKILL)
    results = finish(srv, first, joiner)
    assert [rc for rc, _ in results] == [0, 0, 0], results
    log = events(run_dir)
    assert {"kind": "leave", "worker": slot, "reason": "expired"}.items() <= next(
        e for e in log if e["kind"] == "leave"
    ).items()
    joins = [i for i, e in enumerate(log) if e["kind"] == "join"]
    assert len(joins) == 3 and joins[-1] > min(i for i, e in enumerate(log) if e["kind"] == "push")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["inner_steps"] == 3 * 8 * 10  # the abandoned job's steps were re-offered
    check_summary(summary, run_dir, tokens_per_step=4 * 32, inner_steps=10)  # each worker's own counts
    assert replay(run_dir)["bitwise_equal"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", [pytest.param("async", marks=pytest.mark.slow), "diloco"])
def test_server_killed_and_resumed_loses_and_repeats_nothing(tmp_path, method):
    """kill -9 of the server mid-run (in sync mode: mid-round), then `diloco serve --resume`: the
    workers carry on; every acknowledged push is applied exactly once, and the whole log still
    replays bit for bit."""
    port = free_port()
    rounds = 12 if method == "async" else 6
    run = ["--method", method, "--workers", "2", "--inner-steps", "10", "--rounds", str(rounds)]
    srv = serve(tmp_path, *run, port=port)
    run_dir = tmp_path / "run"
    addr = address(run_dir)
    workers = [worker(addr, "--slowdown", "4"), worker(addr, "--slowdown", "8")]

    def mid_run() -> bool:
        log = events(run_dir)
        pushes = sum(e["kind"] == "push" for e in log)
        return pushes >= 5 and (method == "async" or log[-1]["kind"] == "push")  # sync: one pushed, one not

    wait_for(mid_run, what="the middle of the run")
    srv.send_signal(signal.SIGKILL)
    srv.communicate()
    time.sleep(1.0)
    again = serve(tmp_path, "--resume", str(run_dir), port=port)
    results = finish(again, *workers)
    assert [rc for rc, _ in results] == [0, 0, 0], results
    log = events(run_dir)
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    pushed = [e["job"] for e in log if e["kind"] == "push"]
    assert len(pushed) == len(set(pushed))
    if method == "async":
        assert sorted(pushed) == sorted(e["job"] for e in log if e["kind"] == "apply")
    else:  # every push lands in a round that closed, and every round closed once
        assert [e["round"] for e in log if e["kind"] == "close"] == list(range(1, rounds + 1))
        assert len(pushed) == 2 * rounds
    acknowledged = sum(
        int(err.split(" pushes of this worker")[0].rsplit(" ", 1)[1]) for _, err in results[1:]
    )
    assert acknowledged == len(pushed)
    assert json.loads((run_dir / "summary.json").read_text())["inner_steps"] == 2 * rounds * 10
    assert replay(run_dir)["bitwise_equal"]


@pytest.mark.slow  # long; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(180)
def test_a_paused_worker_loses_its_slot_and_cannot_act_for_its_successor(tmp_path):
    """A worker frozen (SIGSTOP: a network gone quiet) past its lease is replaced by a new worker
    in its slot; woken up, its push is answered late, it is unknown under its old registration,
    and it waits for a free slot: nothing it sends changes the run, which still replays."""
    run = ["--method", "async", "--workers", "2", "--inner-steps", "10", "--rounds", "16"]
    srv = serve(tmp_path, *run, "--worker-timeout-s", "2")
    run_dir = tmp_path / "run"
    addr = address(run_dir)
    steady, frozen = worker(addr, "--slowdown", "8"), worker(addr, "--slowdown", "8", "--retry-s", "10")
    wait_for(lambda: sum(e["kind"] == "push" for e in events(run_dir)) >= 3, what="three pushes")
    slot = slot_of(run_dir, frozen)
    frozen.send_signal(signal.SIGSTOP)
    wait_for(
        lambda: any(e["kind"] == "leave" and e["worker"] == slot for e in events(run_dir)), what="expiry"
    )
    successor = worker(addr, "--slowdown", "8")
    wait_for(lambda: slot_of(run_dir, successor) == slot, what="the successor in the slot")
    joined = max(e["seq"] for e in events(run_dir) if e["kind"] == "join")
    frozen.send_signal(signal.SIGCONT)
    results = finish(srv, steady, successor, frozen)
    # the old holder waits for a free slot and hears that the run is over while the server lingers
    # for it; on a machine slow enough to miss that window it gives up after --retry-s (exit 2)
    assert [rc for rc, _ in results[:3]] == [0, 0, 0] and results[3][0] in (0, 2), results
    log = events(run_dir)
    successor_jobs = {
        e["job"] for e in log if e["kind"] == "dispatch" and e["seq"] > joined and e["worker"] == slot
    }
    pushed_after = {
        e["job"] for e in log if e["kind"] == "push" and e["seq"] > joined and e["worker"] == slot
    }
    assert pushed_after and pushed_after <= successor_jobs  # the old holder pushed nothing that counted
    if results[3][0] == 0:  # it was heard: told its push was late, that its lease ran out, or (its
        # heartbeat answered before its job ended, on a slower machine) that the run is over
        heard = ("lease ran out", "came too late", "the server says the run is over")
        assert any(said in results[3][1] for said in heard), results[3][1]
    assert json.loads((run_dir / "summary.json").read_text())["inner_steps"] == 2 * 16 * 10
    assert replay(run_dir)["bitwise_equal"]


@pytest.mark.slow  # long; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(120)
def test_sync_round_timeout_drops_the_late_worker(tmp_path):
    """Sync with --round-timeout-s: a much slower worker's outer_grads arrive after their round
    closed and are dropped (the other's weight becomes 1); it rejoins each round from θ. Its job
    of 4 steps at 200× takes 800 step times, 1.6-16 s for a step of 2-20 ms: after the 1 s
    timeout, and well before the 16 rounds (16 s or more) end."""
    run = ["--workers", "2", "--inner-steps", "4", "--rounds", "16", "--round-timeout-s", "1"]
    srv = serve(tmp_path, *run, "--worker-timeout-s", "10")
    run_dir = tmp_path / "run"
    addr = address(run_dir)
    fast = worker(addr)
    wait_for(lambda: any(e["kind"] == "join" for e in events(run_dir)), what="the first worker")
    slow = worker(addr, "--slowdown", "200")
    results = finish(srv, fast, slow)
    assert [rc for rc, _ in results] == [0, 0, 0], results
    log = events(run_dir)
    late = [e for e in log if e["kind"] == "late"]
    assert late and {e["worker"] for e in late} == {1}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [w["jobs"] for w in summary["workers"]] == [summary["outer_updates"], 0]
    assert summary["outer_updates"] >= 2  # every round the fast worker made in time
    # the slow worker was in every round but none of its steps arrived: they count nowhere
    assert summary["inner_steps_per_worker"] == [4 * summary["outer_updates"], 0]
    check_summary(summary, run_dir, tokens_per_step=4 * 32, inner_steps=4)
    assert replay(run_dir)["bitwise_equal"]


@pytest.mark.timeout(90)
def test_a_worker_mid_job_hears_that_the_run_is_over(tmp_path):
    """The run ends while a worker is inside a job far longer than the server lingers for its
    stragglers (10 s at most): its heartbeat hears that the run is over, it drops the job and
    exits 0, instead of pushing to a server that is gone and giving up with exit 2."""
    # rounds of 2 s: the slow worker, which builds its model after it registers, fetches its job
    # within the first (with rounds of 1 s, a loaded machine had the run over before it asked)
    run = ["--workers", "2", "--inner-steps", "4", "--rounds", "2", "--round-timeout-s", "2"]
    srv = serve(tmp_path, *run, "--worker-timeout-s", "4")  # a heartbeat each second
    run_dir = tmp_path / "run"
    addr = address(run_dir)
    fast = worker(addr)
    wait_for(lambda: any(e["kind"] == "join" for e in events(run_dir)), what="the first worker")
    slow = worker(addr, "--slowdown", "100000", "--retry-s", "5")  # its first step alone: minutes
    results = finish(srv, fast, slow)
    assert [rc for rc, _ in results] == [0, 0, 0], results
    assert "the server says the run is over" in results[2][1], results[2][1]
    log = events(run_dir)
    assert not [e for e in log if e["kind"] in ("push", "late") and e["worker"] == 1]
    assert json.loads((run_dir / "summary.json").read_text())["outer_updates"] == 2


@pytest.mark.timeout(60)
def test_a_worker_whose_server_is_gone_gives_up_with_one_sentence(tmp_path):
    proc = worker(f"127.0.0.1:{free_port()}", "--retry-s", "1")
    ((rc, err),) = finish(proc)
    assert rc == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("diloco: error: cannot reach the server at 127.0.0.1:")
    assert "Traceback" not in err


@pytest.mark.slow  # suite time; user data and HF models vs the simulator: test_collective, test_hf
@pytest.mark.timeout(180)
def test_user_data_bpe_and_a_hugging_face_model_through_the_server_equal_the_simulator(tmp_path):
    """The model config travels inside the run's settings; each worker reads the same --data
    files and tokenises them itself (its own cache), and the run equals the simulator's."""
    data, llama = user_files(tmp_path)
    tied = {**json.loads(Path(llama).read_text()), "tie_word_embeddings": True}  # saved once, replayed
    Path(llama).write_text(json.dumps(tied))
    data = ["--data", data, "--tokenizer", "bpe:280"]
    run = [
        "--workers",
        "2",
        "--inner-steps",
        "4",
        "--rounds",
        "2",
        *data,
        "--model-config",
        str(tmp_path / "llama.json"),
    ]
    no_gpt_sizes = "[inner]\nwarmup_steps = 2\n"  # the model is the Llama config's
    srv = serve(tmp_path, *run, toml=no_gpt_sizes)
    own_cache = {**ENV, "DILOCO_CACHE": str(tmp_path / "worker-cache")}
    workers = [worker(address(tmp_path / "run"), env=own_cache) for _ in range(2)]
    results = finish(srv, *workers)
    assert [rc for rc, _ in results] == [0, 0, 0], results
    assert (tmp_path / "worker-cache").is_dir()  # the workers tokenised (and trained the BPE) themselves
    (tmp_path / "sim.toml").write_text(no_gpt_sizes)
    cmd = ["train", "--config", str(tmp_path / "sim.toml"), *SMALL, *run, "--procs", "1"]
    assert main([*cmd, "--out", str(tmp_path / "sim")]) == 0
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == (
        tmp_path / "sim" / "model.safetensors"
    ).read_bytes()
    assert replay(tmp_path / "run")["bitwise_equal"]


@pytest.mark.slow  # the suite's 10 minutes; tests/unit/test_shard_plan.py covers the plan itself
@pytest.mark.timeout(180)
def test_a_worker_whose_k_means_differs_trains_on_the_servers_shard_plan(tmp_path):
    """A worker on "another machine", whose own k-means would come out otherwise (tests/
    other_machine: its clusters in reverse order), cuts its shards by the plan the server sent,
    which the server recorded in shards.json: the run replays bit for bit from that file."""
    other = str(Path(__file__).parents[1] / "other_machine")
    env = {**ENV, "PYTHONPATH": os.pathsep.join(p for p in (other, ENV.get("PYTHONPATH")) if p)}
    check = [sys.executable, "-c", "from diloco.data import shards; print(shards.kmeans_groups.__name__)"]
    assert subprocess.run(check, env=env, capture_output=True, text=True).stdout == "<lambda>\n"
    srv = serve(tmp_path, "--workers", "2", "--inner-steps", "4", "--rounds", "2", "--shards", "kmeans")
    addr = address(tmp_path / "run")
    results = finish(srv, worker(addr), worker(addr, env=env))
    assert [rc for rc, _ in results] == [0, 0, 0], results
    plan = json.loads((tmp_path / "run" / "shards.json").read_text())
    assert plan["kind"] == "kmeans" and len(plan["groups"]) == 2
    assert replay(tmp_path / "run")["bitwise_equal"]


@pytest.mark.timeout(180)
def test_async_deadline_jobs_on_the_server_replay_bit_for_bit(tmp_path):
    """`--dylu-by time` on the server: after its probe each job is a deadline of H × the fastest
    measured seconds per step (6 × 20 ms here) reserving the steps expected to fit; the push says
    how many it took, the budget counts those, and `diloco replay` re-runs exactly them."""
    run = ["--method", "async", "--workers", "2", "--inner-steps", "6", "--rounds", "6", "--dylu-by", "time"]
    srv = serve(tmp_path, *run)
    at = address(tmp_path / "run")
    # the second worker turns 2.5x slower 0.3 s into its steps: its next jobs reserve steps at the
    # speed measured before and it takes fewer (the push says how many; replay runs those)
    slowing = worker(at, "--step-s", "0.02", "--slowdown", "2.5@0.3-inf")
    results = finish(srv, worker(at, "--step-s", "0.02"), slowing)
    assert [rc for rc, _ in results] == [0, 0, 0], results
    log = events(tmp_path / "run")
    dispatched = {e["job"]: e for e in log if e["kind"] == "dispatch"}
    pushed = [e for e in log if e["kind"] == "push"]
    deadlines = [d for d in dispatched.values() if d["seconds"] is not None]
    # 6 x the measured s/step: 0.12 s on an idle machine; a loaded one (CI) measures steps slower
    assert len(deadlines) >= 4 and all(0.06 <= d["seconds"] < 0.6 for d in deadlines)
    for p in pushed:
        d = dispatched[p["job"]]
        assert 1 <= p["steps"] <= (2 * d["steps"] if d["seconds"] is not None else d["steps"])
    assert any(p["steps"] != dispatched[p["job"]]["steps"] for p in pushed)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["inner_steps"] == sum(p["steps"] for p in pushed) >= 72
    assert replay(tmp_path / "run")["bitwise_equal"]
