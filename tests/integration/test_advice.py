"""Every refusal names a step that works: each test takes the step its message advises and sees it
work (or get past that refusal)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import TINY_LLAMA
from test_bad_input import _run_in_process, _smallest_run

from diloco.cli.main import main


@pytest.fixture
def small(tmp_path, monkeypatch):
    """Flags of a two-round run of a one-block GPT on small text files (fast to evaluate)."""
    monkeypatch.chdir(tmp_path)
    _text_files(tmp_path)
    return [*_smallest_run(tmp_path, rounds=2), "--data", "train.txt", "--val-data", "val.txt"]


def _text_files(folder) -> None:
    (folder / "train.txt").write_text("".join(f"Line {i}: to be, or not to be.\n" for i in range(400)))
    (folder / "val.txt").write_text("Now is the winter of our discontent. " * 60)


def _cli(tmp_path, *args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diloco", *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(90)
def test_max_staleness_advises_diloco_serve_which_takes_it(tmp_path, small, capsys):
    code, err = _run_in_process(capsys, ["train", *small, "--max-staleness", "2", "--out", "x"])
    assert code == 2 and "run it with diloco serve" in err and "add --runtime server" not in err
    assert not (tmp_path / "x").exists()
    i = small.index("--procs")
    flags = small[:i] + small[i + 2 :]  # a server has no simulated processes
    cmd = ["serve", *flags, "--max-staleness", "2", "--method", "async", "--out", "srv", "--port", "0"]
    cmd += ["--http-port", "-1", "--insecure-no-token", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "diloco", *cmd], cwd=tmp_path, env=env, text=True)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "srv" / "server.json").exists():  # listening: the flag was taken
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        assert json.loads((tmp_path / "srv" / "config.json").read_text())["max_staleness"] == 2
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:  # never leave the server behind (a failed wait, the test's timeout)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_changed_text_advises_a_new_run_and_eval_on_the_text(tmp_path, small, capsys):
    (tmp_path / "d.txt").write_text("to be or not to be, that is the question. " * 400)
    data = ["--data", "d.txt", "--checkpoint-every", "1"]
    assert main(["train", *small, *data, "--out", "run", "--stop-after", "1"]) == 0
    (tmp_path / "d.txt").write_text("whether 'tis nobler in the mind to suffer. " * 400)
    code, err = _run_in_process(capsys, ["train", "--resume", "run"])
    # the unfinished run has no model.safetensors: --init-from it would fail
    assert code == 2 and "train a new run on it (diloco train with another --out)" in err
    assert "--init-from" not in err
    assert main(["train", *small, *data, "--out", "new"]) == 0  # the step
    (tmp_path / "d.txt").write_text("the slings and arrows of outrageous fortune. " * 400)
    code, err = _run_in_process(capsys, ["eval", "new"])
    assert code == 2 and "evaluate its model on the text as it is with --data" in err
    assert main(["eval", "new", "--data", "d.txt"]) == 0  # the step


@pytest.mark.timeout(90)
def test_a_non_finite_stop_advises_resume_only_where_a_checkpoint_exists(tmp_path, small, capsys):
    nan = [*small, "--inner-lr", "1e30"]
    proc = _cli(tmp_path, "train", *nan, "--out", "bare")
    assert proc.returncode == 3 and "--resume" not in proc.stderr
    step = "so delete bare (or give another --out) and start again with a lower --inner-lr"
    assert "saved no checkpoint" in proc.stderr and step in proc.stderr
    code, err = _run_in_process(capsys, ["eval", "bare"])
    assert code == 2 and "saved no checkpoint to finish from, so train it again" in err
    assert "or delete bare first" in err and "--resume" not in err
    shutil.rmtree(tmp_path / "bare")  # the step, as said: the same --out, a lower --inner-lr
    assert main(["train", *small, "--inner-lr", "1e-3", "--out", "bare"]) == 0
    assert main(["eval", "bare"]) == 0  # the step: a finished run
    code, err = _run_in_process(capsys, ["train", *nan, "--out", "kept", "--checkpoint-every", "1"])
    assert code == 3 and "continue with diloco train --resume kept if" in err
    assert main(["train", "--resume", "kept", "--no-progress"]) == 3  # the step: it resumes (and stops)


@pytest.mark.timeout(60)
def test_a_stop_after_with_no_round_left_advises_dropping_it(tmp_path, small, capsys):
    assert main(["train", *small, "--checkpoint-every", "1", "--out", "run", "--stop-after", "1"]) == 0
    code, err = _run_in_process(capsys, ["train", "--resume", "run", "--stop-after", "1"])
    assert code == 2 and "drop --stop-after" in err and "from 2 to 1" not in err
    assert main(["train", "--resume", "run", "--no-progress"]) == 0  # the step
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.timeout(60)
def test_fragments_above_inner_steps_advise_a_count_that_works(tmp_path, small, capsys):
    (tmp_path / "four.toml").write_text("[model]\nn_layer = 4\nn_head = 2\nd_model = 16\n")
    flags = [*small, "--config", "four.toml", "--inner-steps", "2"]
    code, err = _run_in_process(capsys, ["train", *flags, "--fragments", "3", "--out", "x"])
    assert code == 2 and "use --fragments 2 or fewer" in err and "= 0" not in err
    assert main(["train", *flags, "--fragments", "2", "--out", "run"]) == 0  # the step


@pytest.mark.timeout(90)
def test_a_zero_block_model_config_advises_blocks_not_fragments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    llama = {**TINY_LLAMA, "vocab_size": 256}  # the byte tokenizer's
    (tmp_path / "zero.json").write_text(json.dumps({**llama, "num_hidden_layers": 0}))
    flags = ["--seq-len", "16", "--batch-size", "2", "--inner-steps", "2", "--rounds", "1"]
    flags += ["--workers", "1", "--procs", "1", "--no-progress"]
    flags += ["--data", "train.txt", "--val-data", "val.txt"]
    _text_files(tmp_path)
    code, err = _run_in_process(capsys, ["train", *flags, "--model-config", "zero.json", "--out", "x"])
    assert code == 2 and "set num_hidden_layers to 1 or more" in err and "at most 0" not in err
    assert not (tmp_path / "x").exists()
    (tmp_path / "one.json").write_text(json.dumps({**llama, "num_hidden_layers": 1}))
    assert main(["train", *flags, "--model-config", "one.json", "--out", "run"]) == 0  # the step


@pytest.mark.timeout(60)
def test_eval_export_and_resume_of_wrong_paths_advise_what_works(tmp_path, small, capsys):
    assert main(["train", *small, "--out", "run"]) == 0
    for args in (["eval", "nowhere"], ["export", "nowhere", "out"]):
        code, err = _run_in_process(capsys, args)
        assert code == 2 and "give the folder a run wrote (its --out)" in err and "--resume" not in err
    (tmp_path / "a-file").write_text("")
    code, err = _run_in_process(capsys, ["train", "--resume", "a-file"])
    assert code == 2 and "a-file is a file, not a run directory; give the folder a run wrote" in err
    code, err = _run_in_process(capsys, ["export", "run", "a-file"])
    assert code == 2 and "a-file is a file; give as OUT_DIR a new (or an empty) folder" in err
    assert (tmp_path / "a-file").read_text() == ""
    (tmp_path / "tiny.txt").write_text("hi")
    code, err = _run_in_process(capsys, ["eval", "run", "--data", "tiny.txt"])
    assert code == 2 and "fewer than one window of this run's model (17 tokens); give more text" in err
    assert "--seq-len" not in err
    (tmp_path / "tiny.txt").write_text("hi there, " * 10)  # the step: more text
    assert main(["eval", "run", "--data", "tiny.txt"]) == 0
    assert main(["export", "run", "exported"]) == 0  # the step: a new folder
    assert main(["eval", "run"]) == 0  # the step: the folder the run wrote
    assert main(["train", *small, "--checkpoint-every", "1", "--out", "part", "--stop-after", "1"]) == 0
    assert main(["train", "--resume", "part", "--no-progress"]) == 0


@pytest.mark.timeout(60)
def test_eval_of_a_diverged_model_is_strict_json_with_null_and_prints_overflow(tmp_path, small):
    import torch
    from safetensors.torch import load_file, save_file

    assert main(["train", *small, "--out", "run"]) == 0
    tensors = load_file(str(tmp_path / "run" / "model.safetensors"))
    save_file(
        {k: torch.full_like(v, float("nan")) for k, v in tensors.items()},
        tmp_path / "run" / "model.safetensors",
    )
    (tmp_path / "some.txt").write_text("to be or not to be " * 20)
    proc = _cli(tmp_path, "eval", "run", "--data", "some.txt", "--json", "--threads", "1")
    assert proc.returncode == 0, proc.stderr

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    result = json.loads(proc.stdout, parse_constant=refuse)
    assert result["val_loss"] is None and result["val_ppl"] is None and result["tokens"] > 0
    # the plain printout of the same model says so too, instead of failing on a missing number
    proc = _cli(tmp_path, "eval", "run", "--data", "some.txt", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    assert "val_loss nan   val_ppl overflow   tokens" in proc.stdout, proc.stdout


@pytest.mark.timeout(90)
def test_ctrl_c_before_any_checkpoint_advises_a_new_start_that_works(tmp_path, small):
    """Ctrl-C of a run that saved no checkpoint: no --resume (it has nothing to continue from),
    but a new start in the same folder once it is deleted, which then runs."""
    cmd = [
        sys.executable,
        "-m",
        "diloco",
        "train",
        *small,
        "--rounds",
        "100000",
        "--threads",
        "1",
        "--out",
        "cut",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "cut" / "metrics.jsonl").exists():  # the loop has started
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:  # never leave a run training (this one would go on for 100000 rounds)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted before any checkpoint, so cut cannot be resumed" in err and "--resume" not in err
    assert "delete it (or give another --out) and start again" in err
    shutil.rmtree(tmp_path / "cut")  # the step
    assert main(["train", *small, "--out", "cut"]) == 0
