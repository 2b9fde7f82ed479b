"""`diloco train`'s flags come from the config fields' metadata: names, dests, help, parsing."""

import dataclasses
import importlib
import json
import os

import pytest
import torch

from diloco import settings
from diloco.cli.main import build_parser, main
from diloco.config import FLAG_GROUPS, TrainConfig, flag, label
from diloco.errors import Interrupted, NonFinite, ReplicaMismatch, RunFailed, UserError

# Every flag `diloco train` had before the flags came from the fields, and the setting it sets.
EXPECTED = {
    "--method": "method",
    "--workers": "num_workers",
    "--inner-steps": "inner_steps",
    "--rounds": "rounds",
    "--model": "model.name",
    "--seq-len": "model.seq_len",
    "--batch-size": "data.batch_size",
    "--shards": "data.shards",
    "--data": "data.paths",
    "--text-field": "data.text_field",
    "--source-field": "data.source_field",
    "--val-data": "data.val_data",
    "--val-fraction": "data.val_fraction",
    "--tune-fraction": "data.tune_fraction",
    "--eval-on": "data.eval_on",
    "--tokenizer": "data.tokenizer",
    "--cache-dir": "data.cache_dir",
    "--model-config": "model.hf_config",
    "--inner-lr": "inner.lr",
    "--warmup-steps": "inner.warmup_steps",
    "--outer-opt": "outer.opt",
    "--outer-lr": "outer.lr",
    "--outer-momentum": "outer.momentum",
    "--seed": "seed",
    "--out": "out",
    "--eval-every": "eval_every",
    "--checkpoint-every": "checkpoint_every",
    "--threads": "threads",
    "--target-loss": "target_loss",
    "--runtime": "runtime",
    "--procs-per-worker": "procs_per_worker",
    "--bucket-mb": "bucket_mb",
    "--round-timeout-s": "round_timeout_s",
    "--worker-timeout-s": "worker_timeout_s",
    "--max-inflight-pushes": "max_inflight_pushes",
    "--max-inflight-downloads": "max_inflight_downloads",
    "--max-update-norm-ratio": "max_update_norm_ratio",
    "--max-staleness": "max_staleness",
    "--drop-prob": "drop_prob",
    "--after-drop": "after_drop",
    "--workers-schedule": "workers_schedule",
    "--codec": "codec",
    "--topk-fraction": "topk_fraction",
    "--topk-chunk": "topk_chunk",
    "--topk-bits": "topk_bits",
    "--ef-decay": "ef_decay",
    "--error-feedback": "error_feedback",
    "--download-codec": "download_codec",
    "--fragments": "fragments",
    "--overlap-steps": "overlap_steps",
    "--mix-alpha": "mix_alpha",
    "--speeds": "sim.speeds",
    "--heterogeneity": "sim.heterogeneity",
    "--speed-jitter": "sim.speed_jitter",
    "--slowdown": "sim.slowdowns",
    "--bandwidth-mbps": "sim.bandwidth_mbps",
    "--latency-ms": "sim.latency_ms",
    "--procs": "sim.procs",
    "--async-rule": "async.rule",
    "--dn-buffer": "async.buffer",
    "--dn-c": "async.dn_c",
    "--poly-threshold": "async.poly_threshold",
    "--delaycomp-lambda": "async.delaycomp_lambda",
    "--dylu": "dylu.enabled",
    "--dylu-oracle": "dylu.oracle",
    "--dylu-alpha": "dylu.alpha",
    "--dylu-by": "dylu.by",
    "--shard-sampling": "async.shard_sampling",
    "--grace-s": "async.grace_s",
    # new settings
    "--init-from": "init_from",
    "--on-nonfinite": "on_nonfinite",
    "--keep-checkpoints": "keep_checkpoints",
    "--timeout-s": "timeout_s",
}
NOT_SETTINGS = {"-h", "--help", "--config", "--resume", "--stop-after", "--progress", "--no-progress"}


def _train_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["train"]


def _exit(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr()


@pytest.fixture
def captured(monkeypatch):
    """Replace the training itself: record the config and arguments `diloco train` would run."""
    calls = []

    def fake_train(cfg, **kw):
        calls.append((cfg, kw))
        return {"stopped_after": 1, "run_dir": str(cfg.run_dir)}

    def fake_exit(code):  # a collective run ends with os._exit, after its report
        raise SystemExit(code)

    monkeypatch.setattr(importlib.import_module("diloco.run.train"), "train", fake_train)
    monkeypatch.setattr("diloco.cli.main.os._exit", fake_exit)
    return calls


def test_every_flag_is_a_field_and_every_flagged_field_a_flag():
    actions = {opt: a for a in _train_parser()._actions for opt in a.option_strings}
    setting_flags = {opt: a.dest for opt, a in actions.items() if opt not in NOT_SETTINGS}
    # a setting that is on by default also has its --no- flag
    negated = {"--no-dylu": "dylu.enabled", "--no-shard-sampling": "async.shard_sampling"}
    assert setting_flags == {**EXPECTED, **negated}
    declared = {s.flag: s.path for s in settings.walk(TrainConfig) if s.flag}
    assert declared == EXPECTED
    for f, path in EXPECTED.items():
        assert flag(path) == f and label(path) == f"{path} ({f})"
    assert flag("model.n_layer") is None and label("inner.beta1") == "inner.beta1"  # TOML-only


# The groups of `diloco train --help`, in order (a title starts so), and non-setting flags in them.
HELP_GROUPS = (
    "the run (",
    "[model] ",
    "[data] ",
    "[inner] ",
    "[outer] ",
    "compression and Streaming DiLoCo",
    "[async] The asynchronous server",
    "[dylu] Dynamic local updates",
    "[sim] The simulator's virtual clock",
    "faults simulated",
    "the collective runtime",
    "the parameter server",
    "checkpoints",
)
NOT_SETTINGS_GROUPS = {
    "--config": "run",
    "--resume": "output",
    "--stop-after": "output",
    "--progress": "output",
}


@pytest.mark.timeout(30)
def test_every_setting_declares_its_help_group():
    sections = settings.sections(TrainConfig)
    for s in settings.walk(TrainConfig):
        # a top-level setting names its group; a section's settings are in the section's
        assert s.group in FLAG_GROUPS, f"{s.path}: give it group= (one of config.FLAG_GROUPS)"
        assert s.section or s.meta.group, s.path
    for name, title in FLAG_GROUPS.items():  # a group without a title is a section, titled by it
        assert title or name in sections, name
        assert any(s.flag and s.group == name for s in settings.walk(TrainConfig)), f"{name} is empty"


@pytest.mark.timeout(30)
def test_train_help_lists_every_flag_in_its_group(capsys):
    parser = _train_parser()
    titled = [g for g in parser._action_groups if g not in (parser._positionals, parser._optionals)]
    assert len(titled) == len(HELP_GROUPS) == len(FLAG_GROUPS)
    for group, start in zip(titled, HELP_GROUPS, strict=True):
        assert group.title.startswith(start), (group.title, start)
    # only -h under the bare "options:"; every other flag in a titled group
    assert [a.option_strings for a in parser._optionals._group_actions] == [["-h", "--help"]]
    assert not parser._positionals._group_actions
    group_of = {
        o: name for name, g in zip(FLAG_GROUPS, titled) for a in g._group_actions for o in a.option_strings
    }
    for s in settings.walk(TrainConfig):
        if s.flag:
            assert group_of[s.flag] == s.group, s.path
    assert group_of["--init-from"] == "model" and group_of["--drop-prob"] == "faults"
    for opt, name in NOT_SETTINGS_GROUPS.items():
        assert group_of[opt] == name, opt
    assert set(group_of) == {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
    code, out = _exit(capsys, ["train", "--help"])
    assert code == 0
    text = out.out.split("\noptions:\n", 1)[1]
    titles = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ")]
    assert len(titles) == len(HELP_GROUPS)
    assert all(t.startswith(start) for t, start in zip(titles, HELP_GROUPS, strict=True)), titles


@pytest.mark.timeout(30)
def test_serve_help_groups_the_same_flags():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    serve = sub.choices["serve"]
    titled = {g.title: g for g in serve._action_groups if g not in (serve._positionals, serve._optionals)}
    assert [a.option_strings for a in serve._optionals._group_actions] == [["-h", "--help"]]
    server = next(g for t, g in titled.items() if t.startswith("the parameter server"))
    assert {"--round-timeout-s", "--host", "--port"} <= {
        o for a in server._group_actions for o in a.option_strings
    }


def test_every_field_has_a_type_the_checks_understand():
    for s in settings.walk(TrainConfig):
        assert settings.describe(s.type)
        assert settings.type_ok(s.type, s.default), s.path


def test_help_states_every_default(capsys):
    code, out = _exit(capsys, ["train", "--help"])
    assert code == 0
    text = " ".join(out.out.split())  # argparse wraps lines
    for s in settings.walk(TrainConfig):
        if s.flag:
            assert s.flag in text and "default:" in settings.help_text(s), s.path
    assert "number of workers k (default: 4)" in text
    assert "(stop | drop; default: stop)" in text
    assert "(default: 300.0)" in text and "(default: the preset's)" in text
    assert "[async] The asynchronous server" in text


def test_no_flags_is_the_default_config(captured, capsys):
    assert main(["train"]) == 0
    ((cfg, kw),) = captured
    assert cfg == TrainConfig()
    assert kw == {"resume": None, "stop_after": None, "progress": None}


def test_flags_reach_their_fields(captured, capsys):
    argv = ["train", "--method", "async", "--workers", "2", "--model", "micro", "--seq-len", "64"]
    argv += ["--speeds", "1,2.5", "--slowdown", "0:2@0-10", "--slowdown", "1:3@5-inf", "--dylu"]
    argv += ["--shard-sampling", "--async-rule", "buffer", "--dn-buffer", "3", "--grace-s", "inf"]
    argv += ["--inner-lr", "3e-4", "--outer-lr", "1", "--on-nonfinite", "drop", "--procs", "1"]
    argv += ["--checkpoint-every", "2", "--keep-checkpoints", "5"]
    assert main(argv) == 0
    cfg = captured[0][0]
    assert (cfg.method, cfg.num_workers, cfg.model.name, cfg.model.seq_len) == ("async", 2, "micro", 64)
    assert cfg.model.d_model == 192  # the preset, then the flag
    assert cfg.sim.speeds == (1.0, 2.5) and cfg.sim.slowdowns == ("0:2@0-10", "1:3@5-inf")
    assert cfg.dylu.enabled and cfg.async_.shard_sampling and not cfg.dylu.oracle
    assert (cfg.async_.rule, cfg.async_.buffer, cfg.async_.grace_s) == ("buffer", 3, "inf")
    assert (cfg.inner.lr, cfg.outer.lr, cfg.on_nonfinite, cfg.sim.procs) == (3e-4, 1.0, "drop", 1)
    assert (cfg.checkpoint_every, cfg.keep_checkpoints) == (2, 5)


def test_async_runs_algorithm_2_unless_a_part_is_switched_off(captured, capsys):
    assert main(["train", "--method", "async"]) == 0
    cfg = captured[-1][0]
    v = cfg.async_
    assert (v.rule, v.buffer, v.dn_c, v.shard_sampling, v.grace_s) == ("dn", 0, 0.0, True, "auto")
    assert cfg.dylu.enabled is None and cfg.dylu.on("async") and not cfg.dylu.on("diloco")
    assert main(["train", "--method", "async", "--no-dylu", "--no-shard-sampling", "--grace-s", "0"]) == 0
    cfg = captured[-1][0]
    assert (cfg.dylu.on("async"), cfg.async_.shard_sampling, cfg.async_.grace_s) == (False, False, 0.0)
    assert main(["train", "--method", "async", "--grace-s", "auto", "--dylu"]) == 0
    assert captured[-1][0].async_.grace_s == "auto" and captured[-1][0].dylu.enabled
    code, out = _exit(capsys, ["train", "--method", "async", "--grace-s", "soon"])
    assert code == 2 and "--grace-s" in out.err
    assert main(["train", "--dylu"]) == 0  # sync DiLoCo with DyLU
    assert captured[-1][0].dylu.on("diloco")
    code, out = _exit(capsys, ["train", "--method", "dp", "--no-dylu"])  # no DyLU to switch off
    assert code == 2 and "dylu.enabled (--dylu) applies only with --method async or diloco" in out.err


def test_a_toml_file_then_flags(captured, tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('runtime = "collective"\ntimeout_s = 30\nnum_workers = 2\n[sim]\nprocs = 0\n')
    code, _ = _exit(capsys, ["train", "--config", str(path), "--timeout-s", "45.5", "--bucket-mb", "4"])
    assert code == 0
    cfg = captured[0][0]
    assert (cfg.runtime, cfg.timeout_s, cfg.bucket_mb, cfg.num_workers) == ("collective", 45.5, 4.0, 2)
    path.write_text('runtime = "collective"\n[sim]\nprocs = 2\n')  # the simulator's, given for collective
    code, out = _exit(capsys, ["train", "--config", str(path)])
    assert code == 2 and "sim.procs (--procs) applies only with --runtime sim" in out.err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--speeds", "1,x"], "--speeds wants positive seconds per step separated by commas, got '1,x'"),
        (["--speeds", "1,-2"], "--speeds wants positive seconds"),
        (["--timeout-s", "soon"], "argument --timeout-s: invalid float value: 'soon'"),
        (["--keep-checkpoints", "2.5"], "argument --keep-checkpoints: invalid int value: '2.5'"),
    ],
)
def test_text_a_flag_cannot_parse_is_argparses_one_line_error(capsys, argv, needle):
    code, out = _exit(capsys, ["train", *argv])
    assert code == 2 and needle in out.err and out.err.count("\n") == 1


@pytest.mark.parametrize(
    "error,code",
    [
        (RunFailed("rank 1 hung in the all-reduce of round 3"), 3),
        (NonFinite("worker 2's training loss is nan at inner step 7"), 3),
        (ReplicaMismatch("global parameters of rank 1 differ from rank 0's after round 2"), 3),
        (UserError("bad input; fix it."), 2),
        (Interrupted("interrupted; continue with: diloco train --resume runs/x"), 130),
        (KeyboardInterrupt(), 130),
    ],
)
def test_exit_codes(monkeypatch, capsys, error, code):
    def fail(cfg, **kw):
        raise error

    monkeypatch.setattr(importlib.import_module("diloco.run.train"), "train", fail)
    assert main(["train"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    if code != 130:
        assert err == f"diloco: error: {error}\n"


def _saved_run(tmp_path, tiny, **kw):
    """A run directory holding only config.json, enough for `--resume` to read the config."""
    run = tmp_path / "saved"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(tiny(out=str(run), **kw).to_dict()))
    return run


def test_resume_accepts_flags_equal_to_the_runs(captured, tiny, tmp_path):
    run = _saved_run(tmp_path, tiny)
    argv = ["--workers", "2", "--inner-steps", "4", "--seq-len", "32", "--stop-after", "1"]
    assert main(["train", "--resume", str(run), *argv]) == 0
    assert captured[-1][0] == tiny(out=str(run))


def test_resume_may_change_runtime_threads_procs_and_timeout(captured, tiny, tmp_path, capsys):
    run = _saved_run(tmp_path, tiny, checkpoint_every=1)
    saved = tiny(out=str(run), checkpoint_every=1)
    assert main(["train", "--resume", str(run), "--threads", "2", "--procs", "2", "--stop-after", "1"]) == 0
    cfg, kw = captured[-1]
    assert cfg == dataclasses.replace(saved, threads=2, sim=dataclasses.replace(saved.sim, procs=2))
    assert kw == {"resume": run, "stop_after": 1, "progress": None}
    # sim -> collective: the saved sim.procs goes back to its default; the timeout is the collective's
    code, _ = _exit(capsys, ["train", "--resume", str(run), "--runtime", "collective", "--timeout-s", "60"])
    assert code == 0
    cfg, _ = captured[-1]
    assert (cfg.runtime, cfg.timeout_s, cfg.sim.procs) == ("collective", 60.0, 0)
    assert dataclasses.replace(cfg, runtime="sim", timeout_s=300.0, sim=saved.sim) == saved


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["--workers", "3", "--inner-steps", "4"],
            "drop the settings that change it (--workers 3 where the run has 2).",
        ),
        (["--keep-checkpoints", "9"], "allows only --runtime, --threads, --procs, --timeout-s, --cache-dir"),
        (["--config", "x.toml"], "drop the settings that change it (--config)"),
        (["--runtime", "collective", "--procs", "2"], "sim.procs (--procs) applies only with --runtime sim"),
        (["--timeout-s", "60"], "timeout_s (--timeout-s) applies only with --runtime collective"),
        (
            ["--runtime", "collective", "--timeout-s", "-1"],
            "timeout_s (--timeout-s) must be a finite number > 0",
        ),
    ],
)
def test_resume_refuses_other_changes(captured, tiny, tmp_path, capsys, argv, needle):
    run = _saved_run(tmp_path, tiny)
    code, out = _exit(capsys, ["train", "--resume", str(run), *argv])
    assert code == 2 and needle in out.err and out.err.count("\n") == 1 and not captured


def test_a_sim_run_with_a_clock_moves_to_collective_without_it(captured, tiny, tmp_path, capsys):
    # the simulated clock never changes a sync run's parameters: moving runtimes resets it
    from diloco.config import SimConfig

    run = _saved_run(tmp_path, tiny, sim=SimConfig(speeds=(1.0, 2.0), latency_ms=5.0, procs=1))
    code, _ = _exit(capsys, ["train", "--resume", str(run), "--runtime", "collective"])
    cfg, _ = captured[0]
    assert code == 0 and cfg.runtime == "collective"
    assert cfg.sim.speeds == () and cfg.sim.latency_ms == 0.0 and cfg.rounds == 3


def _saved_server_run(tmp_path, tiny, serve: dict):
    """A server run directory holding config.json and the server.json record of how it served."""
    from diloco.config import SimConfig

    run = _saved_run(tmp_path, tiny, runtime="server", checkpoint_every=1, sim=SimConfig())
    (run / "server.json").write_text(json.dumps({"address": "x", "pid": 1, "serve": serve}))
    return run


def test_serve_resume_keeps_how_the_run_was_served(captured, tiny, tmp_path, monkeypatch):
    from diloco.runtime.server.security import ServeOptions

    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    for name in ("cert.pem", "key.pem", "token.txt"):
        (tmp_path / name).write_text("x" * 20 + "\n")
    record = {
        "host": "0.0.0.0",
        "port": 7123,
        "http_port": 7124,
        "tls_cert": str(tmp_path / "cert.pem"),
        "tls_key": str(tmp_path / "key.pem"),
        "token": "file",
        "token_file": str(tmp_path / "token.txt"),
    }
    run = _saved_server_run(tmp_path, tiny, record)
    assert main(["serve", "--resume", str(run), "--workers", "2"]) == 0  # a flag equal to the run's
    assert captured[-1][1]["serve"] == ServeOptions(
        "0.0.0.0:7123", tmp_path / "token.txt", False, tmp_path / "cert.pem", tmp_path / "key.pem", 7124
    )
    assert main(["serve", "--resume", str(run), "--port", "7200"]) == 0  # moved: the page goes along
    assert captured[-1][1]["serve"].listen == "0.0.0.0:7200" and captured[-1][1]["serve"].http_port is None


@pytest.mark.parametrize(
    "token,expected",
    [("generated", dict(token_file="RUN/token")), ("none", dict(insecure_no_token=True))],
)
def test_serve_resume_keeps_a_generated_token_or_none(captured, tiny, tmp_path, monkeypatch, token, expected):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    run = _saved_server_run(
        tmp_path, tiny, {"host": "127.0.0.1", "port": 7000, "http_port": -1, "token": token}
    )
    (run / "token").write_text("t" * 20 + "\n")
    assert main(["serve", "--resume", str(run)]) == 0
    opts = captured[-1][1]["serve"]
    for key, value in expected.items():
        assert str(getattr(opts, key)).replace(str(run), "RUN") == str(value)


def test_serve_resume_of_a_run_whose_token_came_from_the_environment_needs_it(
    captured, tiny, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    run = _saved_server_run(tmp_path, tiny, {"host": "127.0.0.1", "port": 7000, "token": "env"})
    code, out = _exit(capsys, ["serve", "--resume", str(run)])
    assert code == 2 and "the run's token came from $DILOCO_TOKEN, which is not set" in out.err
    assert out.err.count("\n") == 1 and not captured


def _commands() -> dict:
    return next(a for a in build_parser()._actions if a.dest == "command").choices


def test_every_option_of_every_command_says_what_it_does():
    for name, parser in _commands().items():
        for action in parser._actions:
            if action.option_strings:
                assert action.help, f"diloco {name} {action.option_strings[0]} has no help"


def test_help_lists_what_each_flag_accepts(capsys):
    train = {a.dest: a.help for a in _train_parser()._actions}
    assert "sim | collective;" in train["runtime"] and "server |" not in train["runtime"]
    assert "diloco serve" in train["runtime"]
    assert "save_pretrained" in train["init_from"]
    assert "--stop-after" in train["resume"]
    plot = {a.dest: a for a in _commands()["plot"]._actions}
    assert all(x in plot["x"].help for x in ("sim_time_s", "local_steps", "bytes_sent"))
    assert _commands()["plot"].parse_args(["r", "--x", "local_steps"]).x == "local_steps"
    code, out = _exit(capsys, ["plot", "r", "--x", "wall"])
    assert code == 2 and "invalid choice: 'wall'" in out.err
    assert _commands()["eval"].parse_args(["r", "--threads", "1"]).threads == 1
    assert _commands()["generate"].parse_args(["r", "--prompt", "p", "--threads", "1"]).threads == 1


def test_negative_numbers_in_exponent_form_are_values(captured, capsys):
    code, out = _exit(capsys, ["train", "--inner-lr", "-1e-3"])
    assert code == 2 and "inner.lr (--inner-lr) must be a finite number > 0.0, got -0.001" in out.err
    assert _commands()["plot"].parse_args(["r", "--ymax", "-2.5E+1"]).ymax == -25.0
    assert main(["train", "--outer-lr", "7e-1", "--no-progress"]) == 0
    assert captured[-1][0].outer.lr == 0.7
    code, out = _exit(capsys, ["train", "--inner-lr", "-x"])  # an option it is not: still refused
    assert code == 2 and "expected one argument" in out.err


def test_more_threads_than_cores_warns(capsys):
    from diloco.run.threads import set_threads

    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        set_threads(cores)
        assert capsys.readouterr().err == ""
        set_threads(cores + 1)
        err = capsys.readouterr().err
        assert f"--threads {cores + 1} is more than the {cores} cores" in err and f"--threads {cores}" in err
    finally:
        torch.set_num_threads(before)


def test_ctrl_c_before_the_run_starts_says_so(monkeypatch, capsys):
    """A bare KeyboardInterrupt (Ctrl-C while the data is prepared) has no message of its own: the
    CLI says what happened, not an empty `diloco: `."""

    def interrupted(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("diloco.run.train"), "train", interrupted)
    code, out = _exit(capsys, ["train", "--no-progress"])
    assert code == 130 and out.err == "diloco: interrupted (Ctrl-C)\n"


def test_serve_resume_with_recorded_files_gone_names_the_record_and_the_flag(
    captured, tiny, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    record = {"host": "127.0.0.1", "port": 7000, "http_port": -1, "token": "generated"}
    record |= {"tls_cert": str(tmp_path / "gone.pem"), "tls_key": str(tmp_path / "gone.key")}
    run = _saved_server_run(tmp_path, tiny, record)
    code, out = _exit(capsys, ["serve", "--resume", str(run)])
    assert code == 2 and out.err.count("\n") == 1 and not captured
    assert f"{tmp_path / 'gone.pem'}, recorded in {run / 'server.json'} as this run's --tls-cert" in out.err
    assert "put it back or give --tls-cert FILE" in out.err
    for name in ("cert.pem", "key.pem"):  # the step: give the files
        (tmp_path / name).write_text("x\n")
    tls = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]
    assert main(["serve", "--resume", str(run), *tls]) == 0
    # a generated token that was deleted: a new one is made (as the token's refusal advises), not a
    # refusal of a --token-file nobody gave; a status page turned off stays off when --port moves it
    opts = captured[-1][1]["serve"]
    assert opts.token_file is None and not opts.insecure_no_token and opts.http_port == -1
    assert main(["serve", "--resume", str(run), *tls, "--port", "7300"]) == 0
    assert captured[-1][1]["serve"].http_port == -1


def test_serve_resume_of_a_run_from_an_older_diloco_keeps_its_address_and_asks_for_its_tls(
    captured, tiny, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    run = _saved_server_run(tmp_path, tiny, {})
    (run / "server.json").write_text(json.dumps({"address": "0.0.0.0:7400", "pid": 1, "tls": False}))
    assert main(["serve", "--resume", str(run)]) == 0
    assert captured[-1][1]["serve"].listen == "0.0.0.0:7400"
    (run / "server.json").write_text(json.dumps({"address": "0.0.0.0:7400", "pid": 1, "tls": True}))
    code, out = _exit(capsys, ["serve", "--resume", str(run)])
    assert code == 2 and "served TLS" in out.err and "give --tls-cert and --tls-key" in out.err


def test_resume_of_a_finished_run_says_so_and_changes_nothing(captured, tiny, tmp_path, capsys):
    from diloco.config import SimConfig

    for command, runtime in (("train", "sim"), ("serve", "server")):
        (tmp_path / command).mkdir()
        run = _saved_run(tmp_path / command, tiny, runtime=runtime, checkpoint_every=1, sim=SimConfig())
        (run / "summary.json").write_text("{}\n")
        before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
        code, out = _exit(capsys, [command, "--resume", str(run)])
        said = f"{run} is a finished run (its summary.json says how it ended); nothing to resume.\n"
        assert code == 0 and out.out == said
        assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before and not captured


def test_serve_resume_of_a_live_run_directory_is_refused_before_its_data_is_prepared(
    captured, tiny, tmp_path, capsys
):
    from diloco.rundir import lock, say_holder

    run = _saved_server_run(tmp_path, tiny, {"host": "127.0.0.1", "port": 7000, "token": "none"})
    held = lock(run)
    say_holder(held, "pid 4242, serving on 127.0.0.1:7000")
    try:
        code, out = _exit(capsys, ["serve", "--resume", str(run)])
    finally:
        held.close()
    assert code == 2 and "in use by a live server (pid 4242, serving on 127.0.0.1:7000)" in out.err
    assert not captured  # refused before train() (its data preparation) was reached
    assert main(["serve", "--resume", str(run)]) == 0 and captured  # released: it resumes


@pytest.mark.parametrize(
    "toml,argv,workers",
    [
        ("", ["--runtime", "collective"], 6),  # one rank a worker
        ("", ["--runtime", "collective", "--procs-per-worker", "2"], 3),
        ('runtime = "collective"\nprocs_per_worker = 3\n', [], 2),  # from the TOML file alike
        ('runtime = "collective"\n', ["--procs-per-worker", "2"], 3),
        ('runtime = "collective"\nnum_workers = 2\n', [], 2),  # given: kept
        ("", ["--runtime", "collective", "--workers", "2"], 2),
        ('runtime = "collective"\n', ["--runtime", "sim"], 4),  # the simulator: the default
    ],
)
def test_under_torchrun_a_collective_runs_workers_follow_its_ranks(
    captured, tmp_path, monkeypatch, capsys, toml, argv, workers
):
    monkeypatch.setenv("WORLD_SIZE", "6")
    path = tmp_path / "c.toml"
    path.write_text(toml)
    code, _ = _exit(capsys, ["train", "--config", str(path), *argv])
    assert code == 0 and captured[-1][0].num_workers == workers
