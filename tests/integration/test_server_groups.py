"""Server workers that are torchrun groups (run/group.py): the ranks of one launch do data
parallel inside every job and are one worker to the server. Real processes: `diloco serve`, and
`torchrun ... -m diloco worker` groups on loopback, compared with the collective runtime's
workers of the same ranks and with `diloco replay`."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_server import ENV, SMALL, TINY, address, events, finish, serve, wait_for, worker

from diloco.run.replay import replay


def group(address: str, ranks: int, *args: str) -> subprocess.Popen:
    """One server worker of `ranks` processes, launched by torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += ["-m", "diloco", "worker", "--server", address, "--threads", "1", *args]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collective(tmp: Path, ranks: int, *args: str) -> subprocess.CompletedProcess:
    (tmp / "tiny.toml").write_text(TINY)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += ["-m", "diloco", "train", "--runtime", "collective", "--config", str(tmp / "tiny.toml"), *SMALL]
    return subprocess.run(cmd + list(args), env=ENV, capture_output=True, text=True, timeout=150, cwd=tmp)


@pytest.mark.timeout(300)
def test_two_groups_of_two_ranks_equal_the_collective_runtime_and_replay(tmp_path):
    """Sync, 2 workers of 2 ranks: the server's global parameters equal the collective
    runtime's (--workers 2 --procs-per-worker 2, 4 ranks) bit for bit, and replay's."""
    run = ["--workers", "2", "--inner-steps", "4", "--rounds", "3", "--procs-per-worker", "2"]
    srv = serve(tmp_path, *run)
    where = address(tmp_path / "run")
    groups = [group(where, 2), group(where, 2)]
    results = finish(srv, *groups, timeout=200)
    assert [rc for rc, _ in results] == [0, 0, 0], [err[-3000:] for _, err in results]

    proc = collective(tmp_path, 4, *run, "--out", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == (
        tmp_path / "c" / "model.safetensors"
    ).read_bytes()
    assert replay(tmp_path / "run")["bitwise_equal"]

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [w["ranks"] for w in summary["workers"]] == [2, 2] and summary["outer_updates"] == 3
    # rounds × H × workers × (2 ranks × batch 4) × seq 32: each worker's batch is 2× --batch-size
    assert (
        summary["tokens"]
        == json.loads((tmp_path / "c" / "summary.json").read_text())["tokens"]
        == 3 * 4 * 2 * 8 * 32
    )
    joins = [e for e in events(tmp_path / "run") if e["kind"] == "join"]
    assert [e["ranks"] for e in joins] == [2, 2] and all(e["group"] for e in joins)
    # the leader speaks for the group: one "joined" line per group, from its rank 0
    assert all(err.count("joined 127.0.0.1") == 1 and "(2 ranks)" in err for _, err in results[1:])


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of `rank` of a torchrun launch (its child process with that RANK), None if none."""
    for proc in Path("/proc").iterdir():
        try:
            if (
                not proc.name.isdigit()
                or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher.pid
            ):
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


@pytest.mark.slow  # the suite's 10 minutes; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(300)
def test_a_mixed_async_run_with_deadline_jobs_completes_and_replays_and_a_group_that_does_not_fit_is_refused(
    tmp_path,
):
    """Async (deadline jobs, the default): one group of 2 ranks and one plain worker, which
    computes the same 2 × --batch-size rows alone. The ranks of the group stop at the same step
    (the leader's clock), the run completes and replays bit for bit. A group of 3 ranks cannot
    split a batch of 2 × --batch-size rows: every rank of it stops with the server's sentence."""
    run = [
        "--method",
        "async",
        "--workers",
        "2",
        "--inner-steps",
        "4",
        "--rounds",
        "6",
        "--procs-per-worker",
        "2",
    ]
    srv = serve(tmp_path, *run)
    where = address(tmp_path / "run")
    odd = group(where, 3)
    ((odd_rc, odd_err),) = finish(odd, timeout=120)
    sentence = (
        "which a group of 3 ranks cannot split evenly; start the worker with a number of ranks that divides 2"
    )
    assert odd_rc != 0 and odd_err.count(sentence) == 3, odd_err[-3000:]
    pair = group(where, 2, "--step-s", "0.05")
    joined = lambda: any(e["kind"] == "join" and e.get("ranks") == 2 for e in events(tmp_path / "run"))  # noqa: E731
    wait_for(joined, timeout=120, what="the group to join")
    single = worker(where, "--step-s", "0.1")
    results = finish(srv, pair, single, timeout=200)
    assert [rc for rc, _ in results] == [0, 0, 0], [err[-3000:] for _, err in results]

    log = events(tmp_path / "run")
    assert not [e for e in log if e["kind"] == "join" and e.get("ranks") == 3]  # refused: never joined
    slot = next(e["worker"] for e in log if e["kind"] == "join" and e.get("ranks") == 2)
    deadline = [e for e in log if e["kind"] == "dispatch" and e["worker"] == slot and e.get("seconds")]
    assert deadline, "the group got no deadline job"
    assert replay(tmp_path / "run")["bitwise_equal"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sorted(w["ranks"] for w in summary["workers"]) == [1, 2]
    # every step of either worker computed 2 × --batch-size rows (it counted one batch's tokens)
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    rows = cfg["data"]["batch_size"] * cfg["procs_per_worker"]
    assert summary["tokens"] == summary["inner_steps"] * rows * cfg["model"]["seq_len"] > 0


@pytest.mark.slow  # the suite's 10 minutes; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(300)
def test_a_rank_killed_mid_job_restarts_its_group_which_takes_its_slot_back(tmp_path):
    """kill -9 of rank 1 of a group mid-job: torchrun restarts the group (--max-restarts), its
    leader registers from the same launch and takes the slot back at once (the old registration
    leaves as "restarted", its job re-offered); the run completes, no acknowledged push is lost
    and none is applied twice, and it replays bit for bit."""
    run = [
        "--method",
        "async",
        "--workers",
        "2",
        "--inner-steps",
        "4",
        "--rounds",
        "4",
        "--procs-per-worker",
        "2",
    ]
    srv = serve(tmp_path, *run, "--worker-timeout-s", "60")
    where, acks = address(tmp_path / "run"), tmp_path / "acks.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
    ]
    cmd += [
        "-m",
        "diloco",
        "worker",
        "--server",
        where,
        "--threads",
        "1",
        "--step-s",
        "0.3",
        "--acks",
        str(acks),
    ]
    pair = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    joined = lambda: any(e["kind"] == "join" and e.get("ranks") == 2 for e in events(tmp_path / "run"))  # noqa: E731
    wait_for(joined, timeout=120, what="the group to join")
    single = worker(where, "--step-s", "0.3")

    def group_job_running() -> bool:
        log = events(tmp_path / "run")
        slots = [e["worker"] for e in log if e["kind"] == "join" and e.get("ranks") == 2]
        return (
            bool(slots)
            and any(e["kind"] == "push" and e["worker"] == slots[0] for e in log)
            and any(e["kind"] == "dispatch" and e["worker"] == slots[0] for e in log[-2:])
        )

    wait_for(group_job_running, timeout=120, what="a job of the group after its first push")
    victim = _rank_pid(pair, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    results = finish(srv, pair, single, timeout=200)
    assert [rc for rc, _ in results] == [0, 0, 0], [err[-3000:] for _, err in results]

    log = events(tmp_path / "run")
    joins = [e for e in log if e["kind"] == "join" and e.get("ranks") == 2]
    restarted = [e for e in log if e["kind"] == "leave" and e["reason"] == "restarted"]
    assert (
        len(joins) == 2
        and joins[0]["worker"] == joins[1]["worker"]
        and joins[0]["group"] == joins[1]["group"]
    )
    assert len(restarted) == 1 and restarted[0]["worker"] == joins[0]["worker"]
    applied = [e["job"] for e in log if e["kind"] == "apply"]
    acked = {json.loads(x)["job"] for x in acks.read_text().splitlines()}
    assert len(applied) == len(set(applied)), "a push applied twice"
    assert acked <= set(applied), "an acknowledged push was lost"
    assert replay(tmp_path / "run")["bitwise_equal"]


@pytest.mark.timeout(120)
def test_a_group_that_cannot_reach_the_server_stops_every_rank_with_one_sentence(tmp_path):
    """The leader retries for --retry-s, then every rank stops with the same sentence (exit 2)."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ((rc, err),) = finish(group(f"127.0.0.1:{port}", 2, "--retry-s", "1"), timeout=100)
    # by sentence, not by line: the two ranks write at once and their lines can run together
    lines = re.findall(r"diloco: error: (cannot reach the server .*?or raise --retry-s\.)", err)
    assert rc != 0 and len(lines) == 2 and lines[0] == lines[1], err[-3000:]
    assert f"cannot reach the server at 127.0.0.1:{port}" in lines[0]
    assert (
        err.count("exitcode  : 2") >= 1
        and "Traceback (most recent call last)" not in err.split("diloco: error")[0]
    )


@pytest.mark.slow  # the suite's 10 minutes; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(300)
def test_a_group_worker_streams_fragments_and_the_run_replays(tmp_path):
    """Streaming DiLoCo (P = 2, τ = 1) with one 2-rank group and one plain worker: the leader
    pushes each fragment and shares each merged one with its ranks; the run replays bit for bit."""
    run = ["--workers", "2", "--inner-steps", "4", "--rounds", "3", "--procs-per-worker", "2"]
    srv = serve(tmp_path, *run, "--fragments", "2", "--overlap-steps", "1")
    where = address(tmp_path / "run")
    results = finish(srv, group(where, 2), worker(where), timeout=240)
    assert [rc for rc, _ in results] == [0, 0, 0], [err[-3000:] for _, err in results]
    log = events(tmp_path / "run")
    assert len([e for e in log if e["kind"] == "push"]) == 2 * 3 * 2
    assert replay(tmp_path / "run")["bitwise_equal"]
