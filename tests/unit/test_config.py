import dataclasses
import json
import math
from pathlib import Path

import pytest

from diloco import settings
from diloco.config import (
    AsyncConfig,
    DyluConfig,
    OuterConfig,
    SimConfig,
    StreamingConfig,
    TrainConfig,
    from_dict,
    load_toml,
    merge,
)
from diloco.core import async_rules, codec, outer, outer_side
from diloco.core.streaming import Schedule
from diloco.errors import UserError

# config.json of an async run written by diloco at commit 32d56f2, when the async rule's settings
# were the table "server" (delaycomp, λ 0.3, no DyLU, grace 1.5 s: none of them defaults)
OLD_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "config_32d56f2.json"


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


def test_on_nonfinite_keep_checkpoints_and_timeout_have_defaults_and_take_values():
    cfg = TrainConfig()
    assert (cfg.on_nonfinite, cfg.keep_checkpoints, cfg.timeout_s) == ("stop", 3, 300.0)
    cfg = from_dict({"on_nonfinite": "drop", "checkpoint_every": 1, "keep_checkpoints": 1})
    assert (cfg.on_nonfinite, cfg.keep_checkpoints) == ("drop", 1)
    assert from_dict({"runtime": "collective", "timeout_s": 0.5}).timeout_s == 0.5


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"out": 5}, "out (--out) must be a string, got 5; set it to a string."),
        ({"rounds": True}, "rounds (--rounds) must be an integer, got True; set it to an integer."),
        ({"num_workers": 2.0}, "num_workers (--workers) must be an integer, got 2.0"),
        ({"inner": {"lr": "x"}}, "inner.lr (--inner-lr) must be a number, got 'x'; set it to a number."),
        ({"inner": {"beta1": False}}, "inner.beta1 must be a number, got False"),
        ({"target_loss": True}, "target_loss (--target-loss) must be a number, got True"),
        ({"sim": {"speeds": ["a"]}}, "sim.speeds (--speeds) must be a list of numbers, got ['a']"),
        ({"sim": {"speeds": "1,2"}}, "sim.speeds (--speeds) must be a list of numbers, got '1,2'"),
        ({"sim": {"slowdowns": [1]}}, "sim.slowdowns (--slowdown) must be a list of strings, got [1]"),
        ({"dylu": {"enabled": 1}}, "dylu.enabled (--dylu) must be true or false or unset, got 1"),
        ({"method": 3}, "method (--method) must be a string, got 3"),
        ({"on_nonfinite": "skip"}, "on_nonfinite (--on-nonfinite) must be one of stop, drop, got 'skip'"),
        ({"keep_checkpoints": 0, "checkpoint_every": 1}, "keep_checkpoints (--keep-checkpoints) must be an"),
        ({"runtime": "collective", "timeout_s": 0}, "timeout_s (--timeout-s) must be a finite number > 0.0"),
        ({"runtime": "collective", "timeout_s": math.inf}, "timeout_s (--timeout-s) must be a finite number"),
        ({"sim": {"slowdowns": ["1:inf@0-10"]}}, "sim.slowdowns (--slowdown) must be W:FACTOR@START-END"),
        ({"sim": {"slowdowns": ["1:nan@0-10"]}}, "a finite FACTOR > 0"),
        ({"sim": {"slowdowns": ["1:0@0-10"]}}, "a finite FACTOR > 0"),
        ({"sim": {"slowdowns": ["1:2@nan-10"]}}, "got '1:2@nan-10'"),
        ({"sim": {"slowdowns": ["1:2@inf-inf"]}}, "got '1:2@inf-inf'"),
        ({"sim": {"slowdowns": ["1:2@5-5"]}}, "START < END"),
        (
            {"async": {"grace_s": math.nan}, "method": "async"},
            "async.grace_s (--grace-s) must be auto, measured or a number",
        ),
    ],
)
def test_every_type_is_checked_with_one_sentence_naming_key_flag_and_type(values, needle):
    with pytest.raises(UserError) as e:
        from_dict(values)
    message = str(e.value)
    assert needle in message and message.endswith(".") and "\n" not in message


def test_an_int_is_a_float_and_inf_is_a_grace_and_a_slowdown_end():
    cfg = from_dict({"inner": {"lr": 1}, "outer": {"lr": 1}, "sim": {"speeds": [1, 2.5, 3, 4]}})
    assert (cfg.inner.lr, cfg.outer.lr, cfg.sim.speeds) == (1, 1, (1, 2.5, 3, 4))
    cfg = from_dict({"method": "async", "server": {"grace_s": math.inf}, "sim": {"slowdowns": ["1:2@5-inf"]}})
    assert cfg.async_.grace_s == "inf" and cfg.sim.slowdowns == ("1:2@5-inf",)


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"async": {"rule": "naive"}}, "async.rule (--async-rule) applies only with --method async (this"),
        ({"async": {"buffer": 2}}, "async.buffer (--dn-buffer) applies only with --method async"),
        ({"async": {"dn_c": 0.1}}, "async.dn_c (--dn-c) applies only with --method async"),
        ({"async": {"poly_threshold": 3}}, "async.poly_threshold (--poly-threshold) applies only with"),
        ({"async": {"delaycomp_lambda": 0.1}}, "async.delaycomp_lambda (--delaycomp-lambda) applies only"),
        (
            {"dylu": {"alpha": 0.9}},
            "dylu.alpha (--dylu-alpha) applies only with dynamic local updates on (this run has them off); "
            "add --dylu or drop it.",
        ),
        (
            {"method": "single", "dylu": {"alpha": 0.9}},
            "dylu.alpha (--dylu-alpha) applies only with --method async or diloco (this run has single)",
        ),
        ({"async": {"grace_s": 1.0}, "method": "single"}, "run has single); add --method async or drop it."),
        ({"dylu": {"oracle": True}}, "dylu.oracle (--dylu-oracle) applies only with dynamic local updates"),
        ({"dylu": {"by": "time"}}, "dylu.by (--dylu-by) applies only with dynamic local updates on"),
        (
            {"method": "async", "dylu": {"by": "time", "enabled": False}},
            "dylu.by (--dylu-by) applies only with dynamic local updates on (this run has them off)",
        ),
        (
            {"dylu": {"enabled": True}, "fragments": 2},
            "dylu.enabled (--dylu) gives each worker its own number of inner steps, but Streaming DiLoCo",
        ),
        (
            {"runtime": "server", "checkpoint_every": 1, "dylu": {"enabled": True, "by": "time"}},
            "dylu.by (--dylu-by) time with --method diloco runs in the simulator and under torchrun",
        ),
        (
            {"method": "async", "runtime": "server", "checkpoint_every": 1, "dylu": {"oracle": True}},
            "dylu.oracle (--dylu-oracle) applies only with --runtime sim (this run has server): it reads "
            "the simulator's true speeds",
        ),
        (
            {"procs_per_worker": 2},
            "procs_per_worker (--procs-per-worker) applies only with --runtime collective",
        ),
        (
            {"bucket_mb": 5},
            "bucket_mb (--bucket-mb) applies only with --runtime collective (this run has sim)",
        ),
        ({"timeout_s": 60}, "timeout_s (--timeout-s) applies only with --runtime collective"),
        (
            {"runtime": "server", "checkpoint_every": 1, "sim": {"speeds": [1, 2, 3, 4]}},
            "sim.speeds (--speeds) applies only with --runtime sim or collective (this run has server): a "
            "server's worker is slowed by its own `diloco worker --slowdown F`",
        ),
        ({"runtime": "collective", "sim": {"heterogeneity": "very"}}, "sim.heterogeneity (--heterogeneity)"),
        ({"runtime": "collective", "sim": {"speed_jitter": 0.1}}, "sim.speed_jitter (--speed-jitter)"),
        (
            {"runtime": "server", "checkpoint_every": 1, "sim": {"slowdowns": ["0:2@0-1"]}},
            "set --runtime sim or collective or drop it.",
        ),
        ({"runtime": "collective", "sim": {"bandwidth_mbps": 10}}, "sim.bandwidth_mbps (--bandwidth-mbps)"),
        ({"runtime": "collective", "sim": {"latency_ms": 5}}, "sim.latency_ms (--latency-ms) applies only"),
        ({"drop_prob": 0.1, "method": "async"}, "drop_prob (--drop-prob) applies only with --method diloco"),
        ({"workers_schedule": "0:1", "method": "dp"}, "workers_schedule (--workers-schedule) applies only"),
        (
            {"keep_checkpoints": 5},
            "keep_checkpoints (--keep-checkpoints) applies only with --checkpoint-every above 0 (this run "
            "has 0)",
        ),
    ],
)
def test_a_setting_that_does_not_apply_is_an_error(values, needle):
    with pytest.raises(UserError) as e:
        from_dict(values)
    assert needle in str(e.value) and str(e.value).endswith(".")


def test_settings_at_their_defaults_apply_anywhere(tiny):
    # the defaults, written out, are not "given": a full config.json resumes in either runtime
    full = TrainConfig().to_dict()
    assert from_dict({**full, "runtime": "collective"}).runtime == "collective"
    assert from_dict({**full, "method": "single"}).method == "single"
    collective = dataclasses.replace(
        tiny(), runtime="collective", procs_per_worker=2, timeout_s=10.0, sim=SimConfig()
    )
    assert from_dict(collective.to_dict()) == collective


def test_async_runs_may_save_checkpoints(tiny):
    assert tiny(method="async", checkpoint_every=1).checkpoint_every == 1


def test_a_config_json_with_the_old_server_table_loads_its_values_into_async():
    old = json.loads(OLD_CONFIG.read_text())
    assert "server" in old and "async" not in old  # the fixture is the old layout
    cfg = from_dict(old)
    v = cfg.async_
    assert (v.rule, v.delaycomp_lambda, v.grace_s) == ("delaycomp", 0.3, 1.5)
    assert (cfg.dylu.enabled, cfg.dylu.alpha, cfg.dylu.oracle) == (False, 0.5, False)  # moved to [dylu]
    assert v != AsyncConfig()
    written = cfg.to_dict()  # what config.json holds from now on
    # the old table's values less DyLU's, which moved to their own table with the one added since
    moved = {"dylu": "enabled", "dylu_alpha": "alpha", "dylu_oracle": "oracle"}
    assert written["async"] == {k: x for k, x in old["server"].items() if k not in moved}
    assert written["dylu"] == {new: old["server"][k] for k, new in moved.items()} | {"by": "auto"}
    assert "server" not in written and "async_" not in written
    assert from_dict(written) == cfg


def test_an_old_toml_server_table_loads_and_async_wins_over_it(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('method = "async"\n[server]\nrule = "naive"\ndn_c = 0.1\n')
    assert from_dict(load_toml(path)).async_.rule == "naive"
    path.write_text('method = "async"\n[server]\nrule = "naive"\ndn_c = 0.1\n[async]\nrule = "buffer"\n')
    v = from_dict(load_toml(path)).async_
    assert (v.rule, v.dn_c) == ("buffer", 0.1)
    path.write_text('method = "async"\n[async]\nrule = "poly"\n')
    assert from_dict(load_toml(path)).async_.rule == "poly"
    with pytest.raises(UserError, match="unknown key 'async_'"):
        from_dict({"async_": {"rule": "poly"}})


def test_choices_come_from_the_components_that_implement_them():
    def choices(path):
        return settings.find(TrainConfig, path).meta.choices

    assert choices("codec") == tuple(codec.CODECS)
    assert choices("download_codec") == codec.DOWNLOAD_CODECS
    assert choices("async.rule") == async_rules.ASYNC_RULES
    assert choices("outer.opt") == outer.OUTER_OPTS
    assert choices("after_drop") == outer_side.AFTER_DROP
    assert choices("on_nonfinite") == outer_side.ON_NONFINITE


def test_each_section_builds_its_component():
    assert isinstance(OuterConfig().build(), outer.Nesterov)
    sgd = OuterConfig(opt="sgd", lr=1.0, momentum=0.5).build()
    assert type(sgd) is outer.SGD and (sgd.lr, sgd.momentum, sgd.nesterov) == (1.0, 0.5, False)
    adam = OuterConfig(opt="adam", lr=0.1, adam_eps=0.2).build()
    assert isinstance(adam, outer.Adam) and adam.eps == 0.2
    rule = AsyncConfig(rule="buffer").build(OuterConfig(lr=0.5), num_workers=3)
    assert isinstance(rule, async_rules.Buffer) and rule.size == 3
    assert isinstance(AsyncConfig().build(OuterConfig(), 2), async_rules.DelayedNesterov)
    assert TrainConfig().streaming.build() is None
    cfg = TrainConfig(inner_steps=10, fragments=2, overlap_steps=2, mix_alpha=0.25)
    assert cfg.streaming == StreamingConfig(10, 2, 2, 0.25)
    assert cfg.streaming.build() == Schedule(10, 2, 2, 0.25)
    cfg = TrainConfig(codec="topk", topk_fraction=0.2, error_feedback=True, download_codec="bf16")
    up, down = cfg.communication.build_upload(), cfg.communication.build_download()
    assert (up.name, up.fraction, up.error_feedback) == ("topk", 0.2, True)
    assert (down.name, down.error_feedback) == ("bf16", False)


@pytest.mark.parametrize(
    "values",
    [{"inner_steps": 2, "fragments": 3}, {"inner_steps": 10, "fragments": 2, "overlap_steps": 5}],
)
def test_streaming_settings_are_checked_once_by_the_schedule(values):
    with pytest.raises(UserError) as from_config:
        from_dict(values)
    with pytest.raises(UserError) as from_schedule:
        Schedule(values["inner_steps"], values["fragments"], values.get("overlap_steps", 0))
    assert str(from_config.value) == str(from_schedule.value)


def test_dylu_settings_of_the_async_table_move_to_dylu_and_a_sync_runs_old_default_means_off():
    # config.json of a sync run before [dylu] held async.dylu = true, the default then: resumed,
    # it must stay plain sync DiLoCo, not switch DyLU on
    sync = from_dict({"method": "diloco", "async": {"dylu": True, "dylu_alpha": 0.5, "dylu_by": "steps"}})
    assert sync.dylu == DyluConfig() and not sync.dylu.on("diloco") and "dylu" not in sync.to_dict()["async"]
    asyn = from_dict({"method": "async", "async": {"dylu": False, "dylu_by": "steps"}})
    assert (asyn.dylu.enabled, asyn.dylu.by) == (False, "auto")  # "steps" was the default, off
    both = from_dict({"method": "async", "async": {"dylu_alpha": 0.25}, "dylu": {"alpha": 0.75}})
    assert both.dylu.alpha == 0.75  # the new place wins
    # an async run from before --dylu-by ran jobs of H_w steps, not today's default deadlines
    older = from_dict({"method": "async", "server": {"rule": "dn", "dylu": True}})
    assert (
        older.dylu.by_for("async") == "steps"
        and from_dict({"method": "async"}).dylu.by_for("async") == "time"
    )


@pytest.mark.timeout(10)
def test_sparseloco_takes_its_message_settings_unless_given():
    from diloco.cli.configure import with_flags

    cfg = with_flags({}, {"outer.opt": "sparseloco"}, "t")
    got = (cfg.codec, cfg.error_feedback, cfg.topk_chunk, cfg.topk_bits, cfg.ef_decay)
    assert got == ("topk", True, 4096, 2, 0.95)
    cfg = with_flags({}, {"outer.opt": "sparseloco", "topk_bits": 3, "ef_decay": 1.0}, "t")
    assert (cfg.topk_bits, cfg.ef_decay, cfg.topk_chunk) == (3, 1.0, 4096)
    assert with_flags({}, {}, "t").topk_chunk == 0  # nothing implied for DiLoCo's own outer step
