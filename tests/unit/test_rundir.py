"""The run directory (diloco.rundir): created never over another run, opened for --resume with
one-sentence refusals, locked by a live server, finished once summary.json exists, and its
config.json read back or refused when damaged. Real files in tmp_path."""

import json
import os

import pytest

from diloco import rundir
from diloco.config import TrainConfig
from diloco.errors import UserError
from diloco.rundir import checkpoint


def _cfg(tmp_path, name="run", **kw) -> TrainConfig:
    return TrainConfig(num_workers=2, inner_steps=2, rounds=1, out=str(tmp_path / name), **kw)


def _one_sentence(e: pytest.ExceptionInfo) -> str:
    """The refusal's text, checked to be one sentence: one line, one full stop (or question
    mark) at its end."""
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith((".", "?")) and ". " not in msg, msg
    return msg


def _with_checkpoint(run_dir, *, fmt=rundir.CHECKPOINT_FORMAT, metrics=True):
    """A run directory holding a checkpoint of round 1 (in `fmt`) and, if `metrics`, a metrics file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.save(run_dir / "checkpoints", 1, {"format": fmt, "round": 1})
    if metrics:
        (run_dir / "metrics.jsonl").write_text('{"kind": "outer", "version": 1}\n')


# -- new_run_dir ------------------------------------------------------------------------------


def test_new_run_dir_creates_the_out_folder_and_takes_an_empty_one(tmp_path):
    run_dir, own = rundir.new_run_dir(_cfg(tmp_path, "a/b"))
    assert (run_dir, own) == (tmp_path / "a" / "b", False) and run_dir.is_dir()
    (tmp_path / "empty").mkdir()
    assert rundir.new_run_dir(_cfg(tmp_path, "empty"))[0] == tmp_path / "empty"


def test_new_run_dir_never_writes_into_another_run(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        rundir.new_run_dir(_cfg(tmp_path, "taken"))
    assert "already exists" in _one_sentence(e) and f"--resume {tmp_path / 'taken'}" in str(e.value)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["config.json"]
    (tmp_path / "a-file").write_text("keep")
    with pytest.raises(UserError) as e:
        rundir.new_run_dir(_cfg(tmp_path, "a-file"))
    assert "is a file, not a directory" in _one_sentence(e)
    assert (tmp_path / "a-file").read_text() == "keep"


def test_the_collective_runtime_refuses_a_folder_that_holds_anything(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(UserError) as e:
        rundir.new_run_dir(_cfg(tmp_path, "taken", runtime="collective"))
    assert "never renames it" in _one_sentence(e)


def test_default_names_count_up_instead_of_reusing_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(num_workers=2, inner_steps=3, seed=5)
    names = [rundir.new_run_dir(cfg)[0] for _ in range(3)]
    assert [str(p) for p in names] == [f"runs/diloco-k2-H3-s5{n}" for n in ("", "-2", "-3")]
    assert all((tmp_path / p).is_dir() for p in names)


def test_a_folder_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError) as e:
        rundir.new_run_dir(_cfg(tmp_path, "a-file/run"))
    assert "cannot create run directory" in _one_sentence(e)


# -- open_run ---------------------------------------------------------------------------------


def test_open_run_without_resume_starts_a_new_directory_from_scratch(tmp_path):
    cfg = _cfg(tmp_path)
    assert rundir.open_run(cfg, None, restarted=False) == (tmp_path / "run", None)


def test_open_run_resumes_from_the_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    _with_checkpoint(run)
    checkpoint.save(run / "checkpoints", 2, {"format": rundir.CHECKPOINT_FORMAT, "round": 2})
    run_dir, state = rundir.open_run(_cfg(tmp_path), run, restarted=False)
    assert run_dir == run and state["round"] == 2


@pytest.mark.parametrize(
    "setup,needle",
    [
        (lambda run: run.mkdir(), "has no checkpoint to resume from"),
        (lambda run: _with_checkpoint(run, metrics=False), "has no metrics.jsonl"),
        (lambda run: _with_checkpoint(run, fmt=1), "was written by an older diloco"),
    ],
    ids=["no-checkpoint", "no-metrics", "old-format"],
)
def test_open_run_refuses_what_cannot_be_resumed_in_one_sentence(tmp_path, setup, needle):
    run = tmp_path / "run"
    setup(run)
    with pytest.raises(UserError) as e:
        rundir.open_run(_cfg(tmp_path), run, restarted=False)
    assert needle in _one_sentence(e)


# -- resume_command, finished -----------------------------------------------------------------


def test_resume_command_names_the_verb_of_the_runtime_and_only_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert rundir.resume_command(_cfg(tmp_path), run) is None
    _with_checkpoint(run)
    assert rundir.resume_command(_cfg(tmp_path), run) == f"diloco train --resume {run}"
    served = _cfg(tmp_path, runtime="server", checkpoint_every=1)
    assert rundir.resume_command(served, run) == f"diloco serve --resume {run}"


def test_a_run_is_finished_once_its_summary_exists(tmp_path):
    assert not rundir.finished(tmp_path)
    _with_checkpoint(tmp_path)
    assert not rundir.finished(tmp_path)
    (tmp_path / "summary.json").write_text("{}")
    assert rundir.finished(tmp_path)


# -- lock -------------------------------------------------------------------------------------


def test_a_held_lock_refuses_a_second_server_naming_the_first(tmp_path):
    held = rundir.lock(tmp_path)
    try:
        assert (tmp_path / rundir.LOCK_FILE).read_text() == f"pid {os.getpid()}\n"
        rundir.say_holder(held, "pid 1 at localhost:7000")
        for probe in (False, True):
            with pytest.raises(UserError) as e:
                rundir.lock(tmp_path, probe=probe)
            assert "in use by a live server (pid 1 at localhost:7000)" in _one_sentence(e)
    finally:
        held.close()
    again = rundir.lock(tmp_path)  # closing the file (the process ending) releases it
    again.close()


def test_a_probe_holds_nothing(tmp_path):
    assert rundir.lock(tmp_path, probe=True) is None
    held = rundir.lock(tmp_path)  # the probe left it free
    held.close()


# -- config.json ------------------------------------------------------------------------------


def test_write_config_then_load_run_config_gives_the_same_config(tmp_path):
    cfg = _cfg(tmp_path, "elsewhere", codec="int8")
    (tmp_path / "run").mkdir()
    written = rundir.write_config(cfg, tmp_path / "run")
    assert written.out == str(tmp_path / "run")  # config.json names the directory it is in
    assert rundir.load_run_config(tmp_path / "run") == written


@pytest.mark.parametrize(
    "text,needle",
    [
        (None, "config.json does not exist"),
        ('{"num_workers": 2', "is not valid JSON"),
        (json.dumps({"num_workerz": 2}), "unknown key 'num_workerz'"),
        (json.dumps({"num_workers": 0}), "num_workers (--workers) must be an integer >= 1, got 0"),
        (json.dumps({"inner": {"lr": "fast"}}), "inner.lr (--inner-lr) must be a number"),
    ],
    ids=["missing", "truncated", "unknown-key", "out-of-range", "wrong-type"],
)
def test_a_damaged_config_json_is_refused_in_one_sentence(tmp_path, text, needle):
    run = tmp_path / "run"
    run.mkdir()
    if text is not None:
        (run / "config.json").write_text(text)
    with pytest.raises(UserError) as e:
        rundir.load_run_config(run)
    assert needle in _one_sentence(e)


def test_load_run_config_of_a_missing_folder_or_a_file_says_which(tmp_path):
    with pytest.raises(UserError) as e:
        rundir.load_run_config(tmp_path / "nope")
    assert "does not exist" in _one_sentence(e)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError) as e:
        rundir.load_run_config(tmp_path / "a-file")
    assert "is a file, not a run directory" in _one_sentence(e)
