import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from diloco.errors import UserError
from diloco.model.init import with_tied
from diloco.rundir import checkpoint


def _state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "round": 3,
        "nested": [1.5, "x", None, (2, 3)],
    }


@pytest.mark.timeout(30)
def test_round_trip_restores_every_value(tmp_path):
    state = _state()
    path = checkpoint.save(tmp_path, 3, state)
    assert path.name == "round-000003" and checkpoint.latest(tmp_path) == path
    back = checkpoint.load(path)
    assert back["round"] == 3 and back["nested"] == [1.5, "x", None, [2, 3]]
    assert torch.equal(back["rng"], state["rng"])
    assert set(back["opt"]["state"]) == {0, 1}  # integer keys survive
    for key in state["model"]:
        assert torch.equal(back["model"][key], state["model"][key])
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(back["opt"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], state["opt"]["state"][0]["exp_avg"])


@pytest.mark.timeout(30)
def test_latest_ignores_unfinished_and_corruption_is_reported(tmp_path):
    checkpoint.save(tmp_path, 1, _state())
    path = checkpoint.save(tmp_path, 2, _state())
    (tmp_path / ".tmp-round-000003").mkdir()  # a crash mid-save leaves only this
    assert checkpoint.latest(tmp_path) == path and checkpoint.rounds(tmp_path) == [1, 2]
    assert checkpoint.rounds(tmp_path / "none") == []
    data = bytearray((path / "state.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "state.safetensors").write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt"):
        checkpoint.load(path)
    (path / "checksums.json").unlink()
    with pytest.raises(UserError, match="unreadable"):
        checkpoint.load(path)


# --- crash safety: corrupt checkpoints, pruning, replacement, SIGKILL at any moment ---------------


def _filled(round_: int, n: int = 1000) -> dict:
    return {
        "a": torch.full((n,), float(round_)),
        "b": {"c": torch.full((n // 10, 3), round_, dtype=torch.int64)},
        "round": round_,
        "loss": float("nan") if round_ % 2 else float("inf"),
    }


def _check(path, state, round_):
    assert path.name == f"round-{round_:06d}" and state["round"] == round_
    assert torch.equal(state["a"], torch.full_like(state["a"], float(round_)))
    assert torch.equal(state["b"]["c"], torch.full_like(state["b"]["c"], round_))


def _rounds(d):
    return sorted(p.name for p in d.iterdir() if p.name.startswith("round-"))


def _flip(path):
    data = bytearray((path / "state.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / "state.safetensors").write_bytes(bytes(data))


def _truncate(path):
    f = path / "state.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def _no_checksums(path):
    (path / "checksums.json").unlink()


def _bad_checksums_json(path):
    (path / "checksums.json").write_text("{")


def _no_state_json(path):
    (path / "state.json").unlink()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "damage,reason",
    [
        (_flip, "corrupt (state.safetensors fails its checksum)"),
        (_truncate, "corrupt (state.safetensors fails its checksum)"),
        (_no_checksums, "unreadable"),
        (_bad_checksums_json, "unreadable"),
        (_no_state_json, "unreadable"),
    ],
)
def test_latest_valid_falls_back_past_a_damaged_newest_with_a_warning(tmp_path, capsys, damage, reason):
    for r in (2, 4, 6):
        checkpoint.save(tmp_path, r, _filled(r))
    damage(tmp_path / "round-000006")
    path, state = checkpoint.latest_valid(tmp_path)
    _check(path, state, 4)
    err = capsys.readouterr().err
    assert err.startswith(f"diloco: warning: checkpoint {tmp_path / 'round-000006'} is {reason}")
    assert err.rstrip().endswith(f"resuming from {tmp_path / 'round-000004'}")
    assert err.count("\n") == 1
    with pytest.raises(UserError, match="round-000006"):
        checkpoint.load(tmp_path / "round-000006")  # load() of a damaged checkpoint still raises


@pytest.mark.timeout(30)
def test_latest_valid_none_when_no_checkpoint_and_user_error_when_all_damaged(tmp_path, capsys):
    assert checkpoint.latest_valid(tmp_path / "missing") is None
    assert checkpoint.latest_valid(tmp_path) is None
    (tmp_path / ".tmp-round-000001").mkdir()
    assert checkpoint.latest_valid(tmp_path) is None
    for r in (1, 2):
        _flip(checkpoint.save(tmp_path, r, _filled(r)))
    with pytest.raises(UserError) as e:
        checkpoint.latest_valid(tmp_path)
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'round-000002'} is corrupt (state.safetensors fails its checksum) and no "
        f"older one in {tmp_path} is valid; delete that folder and start the run again without --resume."
    )
    assert "warning" not in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_keeps_exactly_the_newest(tmp_path, keep):
    for r in range(1, 7):
        checkpoint.save(tmp_path, r, _filled(r), keep=keep)
        assert len(_rounds(tmp_path)) == min(r, keep)
    assert _rounds(tmp_path) == [f"round-{r:06d}" for r in range(7 - keep, 7)]
    assert sorted(p.name for p in tmp_path.iterdir()) == _rounds(tmp_path)  # nothing hidden left
    for r in range(7 - keep, 7):
        _check(tmp_path / f"round-{r:06d}", checkpoint.load(tmp_path / f"round-{r:06d}"), r)


@pytest.mark.timeout(30)
def test_keep_none_keeps_all_and_keep_zero_is_refused(tmp_path):
    for r in range(1, 6):
        checkpoint.save(tmp_path, r, _filled(r), keep=None)
    assert len(_rounds(tmp_path)) == 5
    with pytest.raises(ValueError, match="keep"):
        checkpoint.save(tmp_path, 6, _filled(6), keep=0)


@pytest.mark.timeout(30)
def test_resaving_a_round_replaces_it_and_drops_later_stale_rounds(tmp_path):
    for r in (1, 2, 3, 4):
        checkpoint.save(tmp_path, r, _filled(r), keep=None)
    state = _filled(2)
    state["a"] += 0.5
    path = checkpoint.save(tmp_path, 2, state, keep=None)
    back = checkpoint.load(path)
    assert torch.equal(back["a"], torch.full((1000,), 2.5))
    # rounds 3 and 4 came from before the resume that reran round 2: a later resume must not pick them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000001", "round-000002"]


@pytest.mark.timeout(30)
def test_leftovers_of_a_killed_save_are_restored_or_cleaned(tmp_path, capsys):
    for r in (1, 2, 3):
        checkpoint.save(tmp_path, r, _filled(r), keep=None)
    # killed between moving round 3 aside and renaming its replacement in
    (tmp_path / "round-000003").rename(tmp_path / ".replaced-round-000003")
    (tmp_path / ".tmp-round-000003").mkdir()
    # killed while pruning round 1: renamed, half deleted
    (tmp_path / "round-000001").rename(tmp_path / ".old-round-000001")
    (tmp_path / ".old-round-000001" / "state.json").unlink()
    assert checkpoint.latest(tmp_path) == tmp_path / "round-000003"
    path, state = checkpoint.latest_valid(tmp_path)
    _check(path, state, 3)
    assert capsys.readouterr().err == ""
    checkpoint.save(tmp_path, 4, _filled(4), keep=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000002", "round-000003", "round-000004"]


@pytest.mark.timeout(30)
def test_non_finite_floats_round_trip_in_strict_json(tmp_path):
    path = checkpoint.save(tmp_path, 1, {"x": [float("nan"), float("inf"), -float("inf"), 1.5]})
    text = (path / "state.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    x = checkpoint.load(path)["x"]
    assert math.isnan(x[0]) and x[1:] == [math.inf, -math.inf, 1.5]


@pytest.mark.timeout(30)
def test_atomic_writes_leave_only_the_finished_file(tmp_path):
    tensors = {"w": torch.arange(6.0).reshape(2, 3).t(), "b": torch.ones(2)}  # w not contiguous
    checkpoint.atomic_save_safetensors(tensors, tmp_path / "model.safetensors", metadata={"round": "3"})
    checkpoint.atomic_save_safetensors(tensors, tmp_path / "model.safetensors")  # replaces
    back = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(back["w"], tensors["w"]) and torch.equal(back["b"], tensors["b"])
    checkpoint.atomic_write_text(tmp_path / "a.txt", "hello")
    checkpoint.atomic_write_json(tmp_path / "s.json", {"loss": float("nan"), "ok": [1.0, float("inf")]})
    assert json.loads((tmp_path / "s.json").read_text()) == {"loss": None, "ok": [1.0, None]}
    assert (tmp_path / "a.txt").read_text() == "hello"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "model.safetensors", "s.json"]


_SAVER = """
import sys
from pathlib import Path
import torch
from diloco.rundir import checkpoint
d = Path(sys.argv[1])
found = checkpoint.latest_valid(d)
r = int(found[0].name[6:]) + 1 if found else 1
print("ready", flush=True)
while True:
    state = {
        "a": torch.full((1 << 20,), float(r)),  # 4 MB
        "b": {"c": torch.full((100, 3), r, dtype=torch.int64)},
        "round": r,
        "loss": float("nan"),
    }
    checkpoint.save(d, r, state, keep=2)
    print(r, flush=True)
    if r % 2 == 0:  # a rerun of the round: the replacement path
        checkpoint.save(d, r, state, keep=2)
        print(r, flush=True)
    r += 1
"""


@pytest.mark.slow  # ~15 s: `make test-all` runs it (the default suite stays within 10 minutes)
@pytest.mark.timeout(90)  # about 15 s: ten fresh Python processes importing torch
def test_sigkill_at_any_moment_leaves_a_valid_checkpoint(tmp_path, capsys):
    rng = random.Random(1234)
    d = tmp_path / "checkpoints"
    last = 0
    for _ in range(10):
        with open(tmp_path / "stderr.txt", "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", _SAVER, str(d)], stdout=subprocess.PIPE, stderr=err, text=True
            )
            try:
                assert proc.stdout.readline() == "ready\n", (tmp_path / "stderr.txt").read_text()
                time.sleep(rng.uniform(0.0, 0.4))
                assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                saved = [int(line) for line in proc.stdout.read().split()]  # saves that returned
            finally:
                proc.kill()
                proc.wait()
                proc.stdout.close()
        assert "warning" not in (tmp_path / "stderr.txt").read_text()
        found = checkpoint.latest_valid(d)
        if found is None:
            assert last == 0 and not saved
            continue
        path, state = found
        r = int(path.name[6:])
        _check(path, state, r)
        # every save that returned is there; keep=2, plus one not yet pruned
        assert r >= max(saved, default=last) >= last and len(_rounds(d)) <= 3
        for p in _rounds(d):  # every visible folder is a complete checkpoint
            _check(d / p, checkpoint.load(d / p), int(p[6:]))
        last = r
    assert last >= 3, last  # the runs made progress
    assert capsys.readouterr().err == ""


@pytest.mark.timeout(60)
def test_tied_weights_are_saved_once_and_tied_again_on_load(tmp_path):
    from diloco.model.hf import HFCausalLM

    torch.manual_seed(0)
    config = {
        "model_type": "gpt2",
        "n_layer": 1,
        "n_embd": 16,
        "n_head": 2,
        "vocab_size": 300,
        "n_positions": 32,
    }
    model = HFCausalLM(config)  # GPT-2 ties its output head to the token embedding
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    state = model.state_dict()
    checkpoint.atomic_save_safetensors(state, tmp_path / "model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    assert "model.transformer.wte.weight" in saved and "model.lm_head.weight" not in saved
    torch.manual_seed(1)
    again = HFCausalLM(config)
    again.load_state_dict(with_tied(again, saved))
    assert again.model.lm_head.weight is again.model.transformer.wte.weight
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in state.items())
    with torch.device("meta"):  # shapes only, as --init-from checks them
        assert with_tied(HFCausalLM(config), saved).keys() == state.keys()
    # a checkpoint keeps one copy too, and gives both names back
    empty = [torch.zeros(0), torch.zeros(0, 3, dtype=torch.int64)]  # no memory, and not one tensor
    path = checkpoint.save(tmp_path / "checkpoints", 1, {"model": state, "empty": empty})
    assert len(load_file(path / "state.safetensors")) == len(saved) + 2
    assert [(t.shape, t.dtype) for t in checkpoint.load(path)["empty"]] == [(t.shape, t.dtype) for t in empty]
    back = checkpoint.load(path)["model"]
    assert back.keys() == state.keys() and torch.equal(
        back["model.lm_head.weight"], state["model.lm_head.weight"]
    )


@pytest.mark.timeout(30)
def test_safetensors_files_get_the_mode_of_every_other_file(tmp_path):
    old = os.umask(0o022)
    try:
        checkpoint.atomic_save_safetensors({"a": torch.ones(2)}, tmp_path / "model.safetensors")
        checkpoint.atomic_write_json(tmp_path / "summary.json", {})
        path = checkpoint.save(tmp_path / "checkpoints", 1, {"a": torch.ones(2)})
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [*tmp_path.iterdir(), *path.iterdir()] if p.is_file()}
    assert set(modes.values()) == {0o644}, modes
