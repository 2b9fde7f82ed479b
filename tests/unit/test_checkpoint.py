import pytest
import torch

from diloco import checkpoint
from diloco.errors import UserError


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


def test_latest_ignores_unfinished_and_corruption_is_reported(tmp_path):
    checkpoint.save(tmp_path, 1, _state())
    path = checkpoint.save(tmp_path, 2, _state())
    (tmp_path / ".tmp-round-000003").mkdir()  # a crash mid-save leaves only this
    assert checkpoint.latest(tmp_path) == path
    data = bytearray((path / "state.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "state.safetensors").write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt"):
        checkpoint.load(path)
    (path / "checksums.json").unlink()
    with pytest.raises(UserError, match="unreadable"):
        checkpoint.load(path)
