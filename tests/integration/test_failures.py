"""Failure cases, each in real processes: torchrun restarts that must not touch another run,
NaN/Inf outer_grads, hung ranks, dead worker processes, user errors and Ctrl-C under torchrun,
and SIGKILLs at random moments of a checkpointing run."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.cli.main import main
from diloco.rundir import checkpoint

TOML = "[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n"
TINY = ["--seq-len", "32", "--batch-size", "4", "--inner-steps", "4", "--threads", "1"]


def _flags(tmp_path, *more):
    path = tmp_path / "tiny.toml"
    path.write_text(TOML)
    return ["--config", str(path), *TINY, *more]


def _torchrun(tmp_path, *flags, env=None, max_restarts=0, timeout=100, popen=False, launch=("--standalone",)):
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node", "2"]
    cmd += ["--max-restarts", str(max_restarts), "-m", "diloco", "train", "--runtime", "collective"]
    cmd += _flags(tmp_path, *flags)
    env = {**os.environ, **(env or {})}
    if popen:
        return subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


def _ours(stderr: str) -> str:
    """What the ranks printed, without torchrun's warnings."""
    return "\n".join(x for x in stderr.splitlines() if x.startswith("diloco"))


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _strict_json_lines(path: Path) -> list[dict]:
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}")

    return [json.loads(x, parse_constant=refuse) for x in path.read_text().splitlines()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "launch",
    [  # both slow for suite time (12-19 s each); the run-directory lock is tested in test_rundir
        pytest.param(("--standalone",), marks=pytest.mark.slow),
        pytest.param(("--nnodes", "1", "--master-port", "29617"), marks=pytest.mark.slow),
    ],
)
def test_a_torchrun_restart_never_takes_over_another_run(tmp_path, launch):
    # torchrun's own run id is "none" for every launch without --standalone: it cannot tell them apart
    out = tmp_path / "earlier"
    proc = _torchrun(tmp_path, "--rounds", "2", "--checkpoint-every", "1", "--out", str(out), launch=launch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = _snapshot(out)
    proc = _torchrun(
        tmp_path, "--rounds", "3", "--inner-lr", "0.01", "--out", str(out), max_restarts=2, launch=launch
    )
    assert proc.returncode != 0
    # refused on the first attempt and on both restarts, by every rank, with one sentence
    assert _ours(proc.stderr).count("already exists") == 6, proc.stderr[-3000:]
    assert _snapshot(out) == before  # byte for byte


@pytest.mark.timeout(60)
def test_a_nan_stops_the_run_with_the_last_checkpoint_intact(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DILOCO_FAULT", "nan:1:6")  # worker 1's step 6: round 2 at H=4
    run = tmp_path / "r"
    code = main(
        [
            "train",
            *_flags(tmp_path, "--rounds", "3", "--checkpoint-every", "1", "--procs", "1"),
            "--out",
            str(run),
        ]
    )
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1, err
    assert "worker 1 produced a non-finite (NaN or Inf) training loss or outer_grad in round 2" in err
    path, state = checkpoint.latest_valid(run / "checkpoints")
    assert path.name == "round-000001" and state["round"] == 1
    _strict_json_lines(run / "metrics.jsonl")
    monkeypatch.delenv("DILOCO_FAULT")
    assert main(["train", "--resume", str(run)]) == 0  # the fault was a one-off: the run goes on


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["diloco", "async"])
def test_on_nonfinite_drop_goes_on_and_keeps_the_files_strict_json(tmp_path, capsys, monkeypatch, method):
    monkeypatch.setenv("DILOCO_FAULT", "nan:1:6")
    run = tmp_path / "r"
    flags = _flags(tmp_path, "--rounds", "3", "--procs", "1", "--method", method, "--on-nonfinite", "drop")
    assert main(["train", *flags, "--out", str(run)]) == 0
    lines = _strict_json_lines(run / "metrics.jsonl")
    summary = json.loads((run / "summary.json").read_text(), parse_constant=lambda c: 1 / 0)
    assert summary["nonfinite_dropped"] == 1 and summary["val_ppl"] is not None
    kind = "inner" if method == "diloco" else "worker"
    assert [x["worker"] for x in lines if x["kind"] == kind and x["train_loss"] is None] == [1]
    if method == "diloco":
        assert summary["outer_updates"] == 3  # worker 0's outer_grad still made round 2's update


@pytest.mark.slow  # long; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(90)
def test_a_hung_rank_ends_the_run_within_the_timeout(tmp_path):
    t0 = time.monotonic()
    proc = _torchrun(
        tmp_path,
        "--rounds",
        "3",
        "--timeout-s",
        "5",
        "--out",
        str(tmp_path / "c"),
        env={"DILOCO_FAULT": "hang:1:5"},
    )
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "rank 0: the outer sync failed after round 1" in proc.stderr, proc.stderr[-3000:]
    assert "a rank hung longer than --timeout-s 5" in proc.stderr


@pytest.mark.timeout(90)
def test_a_dead_worker_process_is_a_clear_error(tmp_path):
    env = {**os.environ, "DILOCO_FAULT": "kill:1:5"}
    cmd = [sys.executable, "-m", "diloco", "train", *_flags(tmp_path, "--procs", "2", "--rounds", "3")]
    proc = subprocess.run(
        cmd + ["--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert (
        "worker process 1 (workers 1, 3) died with exit code -9 (SIGKILL) while computing worker 1"
        in proc.stderr
    )
    assert "EOFError" not in proc.stderr and "Traceback" not in proc.stderr
    # the run saved no checkpoint: its step is to start again, never a --resume that would fail
    step = f"it saved no checkpoint (--checkpoint-every N saves them), so delete {tmp_path / 'r'} (or give"
    assert step in proc.stderr and "another --out) and start the run again" in proc.stderr
    assert "--resume" not in proc.stderr


@pytest.mark.timeout(90)
def test_a_user_error_found_by_rank_0_ends_every_rank_with_its_sentence(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    proc = _torchrun(tmp_path, "--out", str(tmp_path / "taken"))
    assert proc.returncode != 0
    assert _ours(proc.stderr).count("run directory") == 2 and "already exists" in proc.stderr
    assert "Connection closed" not in proc.stderr and "gloo" not in proc.stderr.lower()
    assert (tmp_path / "taken" / "x").read_text() == "keep me"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["every process", "rank 1"])
def test_ctrl_c_under_torchrun_exits_cleanly(tmp_path, target):
    out = tmp_path / "c"
    proc = _torchrun(tmp_path, "--rounds", "400", "--checkpoint-every", "2", "--out", str(out), popen=True)
    try:
        deadline = time.monotonic() + 60
        while (
            checkpoint.latest(out / "checkpoints") is None
            or checkpoint.latest(out / "checkpoints").name < "round-000002"
        ):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        if target == "every process":  # what a terminal's Ctrl-C does
            os.killpg(proc.pid, signal.SIGINT)
        else:
            ranks = subprocess.run(
                ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
            ).stdout.split()
            rank1 = [
                p
                for p in ranks
                if "LOCAL_RANK=1"
                in Path(f"/proc/{p}/environ").read_bytes().decode(errors="replace").replace("\0", " ")
            ]
            os.kill(int(rank1[0]), signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ours = _ours(stderr)
    assert "diloco: interrupted" in ours or "diloco: rank 1 interrupted" in ours, stderr[-3000:]
    # no rank died with a Python traceback of its own or a gloo error
    assert "diloco/" not in stderr and "Connection closed" not in stderr
    if target == "rank 1":  # rank 0 learns it from the broken connection, in one sentence
        assert "another rank stopped (interrupted or died)" in ours or "diloco: interrupted" in ours
    # and the run can go on from its last checkpoint
    assert checkpoint.latest_valid(out / "checkpoints") is not None


@pytest.mark.slow  # ~36 s: `make test-all` runs it (the default suite stays within 10 minutes)
@pytest.mark.timeout(240)
def test_ten_sigkills_at_random_moments_then_resume_end_exactly_where_the_straight_run_does(tmp_path):
    flags = _flags(
        tmp_path, "--rounds", "60", "--checkpoint-every", "1", "--procs", "1", "--keep-checkpoints", "2"
    )
    cmd = [sys.executable, "-m", "diloco", "train"]
    subprocess.run(
        [*cmd, *flags, "--out", str(tmp_path / "straight")],
        check=True,
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    run, rng = tmp_path / "r", random.Random(0)
    first = [*cmd, *flags, "--out", str(run)]
    proc = subprocess.Popen(first, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while checkpoint.latest(run / "checkpoints") is None:  # from its first checkpoint on, always resumable
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    kills = 0
    while kills < 10:
        time.sleep(rng.uniform(0.0, 2.5))
        if proc.poll() is not None:  # it finished before this kill: start over from an earlier round
            break
        proc.kill()
        proc.wait()
        kills += 1
        proc = subprocess.Popen(
            [*cmd, "--resume", str(run)], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
    proc.wait(timeout=120)
    assert proc.returncode == 0, proc.stderr.read()
    assert kills == 10
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["val_loss"] == straight["val_loss"]
    assert resumed["outer_updates"] == 60 and len(list((run / "checkpoints").iterdir())) <= 3
    lines = _strict_json_lines(run / "metrics.jsonl")
    assert [x["version"] for x in lines if x["kind"] == "outer"] == list(range(1, 61))


@pytest.mark.timeout(60)
def test_a_stop_after_behind_the_resumed_round_is_refused(tmp_path, capsys):
    run = tmp_path / "r"
    flags = _flags(tmp_path, "--rounds", "4", "--procs", "1", "--checkpoint-every", "1")
    assert main(["train", *flags, "--stop-after", "2", "--out", str(run)]) == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--stop-after", "2"]) == 2
    assert "--stop-after 2 is not after round 2, where" in capsys.readouterr().err
    assert _snapshot(run) == before
    assert main(["train", "--resume", str(run), "--stop-after", "3"]) == 0
    assert checkpoint.latest(run / "checkpoints").name == "round-000003"


@pytest.mark.timeout(60)
def test_a_single_model_that_diverges_stops_with_exit_code_3(tmp_path, capsys):
    flags = _flags(tmp_path, "--method", "single", "--rounds", "2", "--inner-lr", "1e30")
    assert main(["train", *flags, "--out", str(tmp_path / "r")]) == 3
    assert "the training loss became non-finite (NaN or Inf) in round" in capsys.readouterr().err
    assert main(["train", *flags, "--on-nonfinite", "drop", "--out", str(tmp_path / "s")]) == 2
