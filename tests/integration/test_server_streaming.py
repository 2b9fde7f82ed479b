"""Streaming DiLoCo through the parameter server (runtime/server/fragments.py,
run/streaming_job.py): real `diloco serve` and `diloco worker` processes on loopback, compared
with the simulator's streaming run and with `diloco replay`."""

from __future__ import annotations

import json
import signal
import time

import pytest
from test_server import SMALL, address, events, finish, free_port, serve, wait_for, worker

from diloco.cli.main import main
from diloco.run.replay import replay

FOUR = "[model]\nn_layer = 4\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n"  # four fragments
STREAM = ["--workers", "2", "--inner-steps", "24", "--fragments", "4", "--overlap-steps", "5"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "codec",
    [
        pytest.param(["--codec", "fp32"], marks=pytest.mark.slow),  # the suite's 10 minutes
        ["--codec", "fp4", "--error-feedback", "--download-codec", "bf16"],
    ],
    ids=["fp32", "fp4"],
)
def test_streaming_through_the_server_equals_the_simulator_and_replays(tmp_path, codec):
    """P = 4, τ = 5: the server's global parameters equal `diloco train`'s streaming run in the
    simulator bit for bit, and replay's; workers download θ once and fragments after that."""
    run = [*STREAM, "--rounds", "2", *codec]
    srv = serve(tmp_path, *run, toml=FOUR)
    where = address(tmp_path / "run")
    results = finish(srv, worker(where), worker(where), timeout=240)
    assert [rc for rc, _ in results] == [0, 0, 0], [err[-3000:] for _, err in results]
    (tmp_path / "sim.toml").write_text(FOUR)
    cmd = ["train", "--config", str(tmp_path / "sim.toml"), *SMALL, *run, "--procs", "1"]
    assert main([*cmd, "--out", str(tmp_path / "sim")]) == 0
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == (
        tmp_path / "sim" / "model.safetensors"
    ).read_bytes()
    assert replay(tmp_path / "run")["bitwise_equal"]

    log = events(tmp_path / "run")
    assert [(e["round"], e["fragment"]) for e in log if e["kind"] == "fragment"] == [
        (r, p) for r in (1, 2) for p in range(4)
    ]
    assert sorted((e["worker"], e["fragment"]) for e in log if e["kind"] == "push") == sorted(
        (w, p) for w in (0, 1) for p in range(4) for _ in (1, 2)
    )
    assert [e["keep"] for e in log if e["kind"] == "dispatch"] == [False, False, True, True]
    server, sim = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("run", "sim"))
    assert server["bytes_sent"] == sim["bytes_sent"] and server["bytes_received"] == sim["bytes_received"]


@pytest.mark.slow  # the suite's 10 minutes; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(300)
def test_the_server_killed_mid_fragment_resumes_and_loses_and_repeats_nothing(tmp_path):
    """kill -9 of the server between two fragments' outer steps of a round, then --resume on
    the same port: the workers' pushes and fragment requests are retried, every acknowledged
    fragment is applied once, and the run still replays bit for bit."""
    port = free_port()
    run_dir, acks = tmp_path / "run", tmp_path / "acks.jsonl"
    srv = serve(tmp_path, *STREAM, "--rounds", "3", port=port, toml=FOUR)
    where = address(run_dir)
    workers = [worker(where, "--step-s", "0.05", "--acks", str(acks)) for _ in range(2)]

    def mid_fragment() -> bool:
        log = events(run_dir)
        closes = [e for e in log if e["kind"] == "fragment" and e["round"] == 2]
        return len(closes) in (1, 2) and log[-1]["kind"] in ("push", "fragment")

    wait_for(mid_fragment, timeout=200, what="round 2 between its fragments")
    srv.send_signal(signal.SIGKILL)
    srv.communicate()
    time.sleep(1.0)
    again = serve(tmp_path, "--resume", str(run_dir), port=port, toml=FOUR)
    results = finish(again, *workers, timeout=240)
    assert [rc for rc, _ in results] == [0, 0, 0], [err[-3000:] for _, err in results]
    log = events(run_dir)
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    pushed = [(e["job"], e["fragment"]) for e in log if e["kind"] == "push"]
    assert len(pushed) == len(set(pushed)) == 2 * 3 * 4  # none lost, none twice
    acked = {(a["job"], a["fragment"]) for a in map(json.loads, acks.read_text().splitlines())}
    assert acked <= set(pushed)
    assert [(e["round"], e["fragment"]) for e in log if e["kind"] == "fragment"] == [
        (r, p) for r in (1, 2, 3) for p in range(4)
    ]
    assert replay(run_dir)["bitwise_equal"]


@pytest.mark.slow  # the suite's 10 minutes; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(300)
def test_a_late_workers_fragments_are_dropped_and_it_joins_again_fresh(tmp_path):
    """--round-timeout-s: the fragments close without a worker too slow for the round (the
    weights of those that came rescaled), which is made to leave at the round's end and joins
    again as a fresh worker that is sent θ; the run completes and replays bit for bit."""
    run_dir = tmp_path / "run"
    srv = serve(tmp_path, *STREAM, "--rounds", "3", "--round-timeout-s", "4", toml=FOUR)
    where = address(run_dir)
    fast, slow = worker(where, "--step-s", "0.02"), worker(where, "--step-s", "0.4")
    results = finish(srv, fast, slow, timeout=240)
    assert [rc for rc, _ in results] == [0, 0, 0], [err[-3000:] for _, err in results]
    log = events(run_dir)
    late = [e for e in log if e["kind"] == "leave" and e["reason"] == "late"]
    assert late, "no worker was late"
    rejoined = [e for e in log if e["kind"] == "join" and e["seq"] > late[0]["seq"]]
    assert rejoined and rejoined[0]["worker"] == late[0]["worker"]
    fresh = [
        e
        for e in log
        if e["kind"] == "dispatch" and e["worker"] == late[0]["worker"] and e["seq"] > rejoined[0]["seq"]
    ]
    assert not fresh or fresh[0]["keep"] is False  # a fresh worker is sent θ
    fragments = [e for e in log if e["kind"] == "fragment"]
    assert len(fragments) == 3 * 4
    assert replay(run_dir)["bitwise_equal"]
