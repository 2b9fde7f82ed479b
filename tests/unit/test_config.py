import math

import pytest

from diloco.config import TrainConfig, from_dict, load_toml, merge
from diloco.errors import UserError


def test_defaults_are_the_main_job():
    cfg = TrainConfig()
    assert (cfg.method, cfg.num_workers, cfg.model.name, cfg.outer.opt) == ("diloco", 4, "nano", "nesterov")
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.inner.weight_decay, cfg.inner.grad_clip) == (
        0.7,
        0.9,
        0.1,
        1.0,
    )


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"num_workers": 0}, "num_workers (--workers) must be an integer >= 1"),
        ({"inner_steps": -3}, "inner_steps (--inner-steps)"),
        ({"inner": {"lr": math.nan}}, "inner.lr (--inner-lr) must be a finite number > 0.0"),
        ({"model": {"name": "gigantic"}}, "unknown model 'gigantic'"),
        ({"method": "zip"}, "method (--method) must be one of diloco, async, single, dp"),
        ({"model": {"d_model": 30, "n_head": 4}}, "divisible"),
        ({"bogus": 1}, "unknown key 'bogus'"),
        ({"inner": {"lrr": 1}}, "unknown key 'lrr' in [inner]"),
        ({"num_workers": True}, "num_workers"),
        (
            {"outer": {"momentum": 1.0}},
            "outer.momentum (--outer-momentum) must be a finite number >= 0.0 and < 1.0",
        ),
        ({"outer": {"adam_beta1": 1.0}}, "outer.adam_beta1"),
        ({"inner": {"beta2": 1.0}}, "inner.beta2"),
        ({"model": {"name": ["x"]}}, "unknown model"),
        ({"eval_every": 30}, "must be a multiple of inner_steps (50)"),
    ],
)
def test_bad_settings_name_the_field_and_the_fix(values, needle):
    with pytest.raises(UserError) as e:
        from_dict(values)
    assert needle in str(e.value)
    assert str(e.value).endswith(".")


def test_preset_then_overrides():
    cfg = from_dict({"model": {"name": "micro", "seq_len": 64}})
    assert (cfg.model.d_model, cfg.model.seq_len) == (192, 64)


def test_toml_and_json_round_trip(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('num_workers = 8\n[outer]\nlr = 0.5\n[data]\nshards = "genre"\n')
    cfg = from_dict(merge(load_toml(path), {"outer": {"momentum": 0.8}}))
    assert (cfg.num_workers, cfg.outer.lr, cfg.outer.momentum, cfg.data.shards) == (8, 0.5, 0.8, "genre")
    assert from_dict(cfg.to_dict()) == cfg
    path.write_text("num_workers = [")
    with pytest.raises(UserError, match="not valid TOML"):
        load_toml(path)
    with pytest.raises(UserError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
