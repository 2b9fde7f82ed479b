"""Every user error: exit code 2, one sentence naming the problem and fix, nothing written."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from diloco.cli.main import main


def _run_in_process(capsys, args):
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--workers", "0"], "--workers) must be an integer >= 1, got 0"),
        (["--inner-steps", "-3"], "--inner-steps) must be an integer >= 1, got -3"),
        (["--model", "huge"], "unknown model 'huge'"),
        (["--inner-lr", "nan"], "--inner-lr) must be a finite number > 0.0, got nan"),
        (["--config", "missing.toml"], "config file missing.toml does not exist"),
        (["--shards", "genre", "--workers", "50"], "use --workers 42 or fewer"),
        (["--batch-size", "8000", "--seq-len", "128", "--workers", "8"], "fewer than one batch needs"),
        (["--workers", "four"], "invalid int value: 'four'"),
        (["--resume", "nowhere"], "run directory nowhere does not exist"),
        (["--seed", str(2**64)], "seed (--seed) must be an integer from 0 to 16777215"),
        (["--threads", str(2**32)], "threads (--threads) must be at most 1024"),
        (["--config", "."], "config file . is a folder; give --config the path of a TOML file"),
    ],
)
def test_bad_input_exits_2_with_one_sentence_and_writes_nothing(tmp_path, monkeypatch, capsys, flags, needle):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    extra = [] if "--resume" in flags else ["--out", str(out)]
    code, err = _run_in_process(capsys, ["train", *flags, *extra])
    assert code == 2
    assert needle in err
    assert err.startswith("diloco: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "runs").exists()


@pytest.mark.timeout(30)
def test_resume_of_a_corrupt_or_checkpointless_run(tiny, tmp_path, capsys):
    from diloco.run.train import train

    run = tmp_path / "run"
    train(tiny(checkpoint_every=1, rounds=2, out=str(run)), stop_after=1, progress=False)
    for name in ("round-000000", "round-000001"):  # every checkpoint corrupt: nothing to fall back to
        (run / "checkpoints" / name / "state.json").write_text("{}")
    before = (run / "metrics.jsonl").read_bytes()
    code, err = _run_in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "is corrupt" in err and "no older one" in err and "delete that folder" in err
    assert (run / "metrics.jsonl").read_bytes() == before  # nothing touched
    (run / "config.json").write_text("{not json")
    code, err = _run_in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "is not valid JSON" in err
    (run / "config.json").write_text(json.dumps({"num_workers": 2}))
    shutil.rmtree(run / "checkpoints")
    code, err = _run_in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "has no checkpoint" in err


@pytest.mark.timeout(30)
def test_an_out_that_holds_files_is_a_file_or_cannot_be_made_is_refused(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    code, err = _run_in_process(capsys, ["train", "--out", str(tmp_path / "taken")])
    assert code == 2 and "already exists" in err
    assert (tmp_path / "taken" / "x").read_text() == "keep me"
    (tmp_path / "a-file").write_text("")
    code, err = _run_in_process(capsys, ["train", "--out", str(tmp_path / "a-file")])
    assert code == 2 and "is a file, not a directory" in err
    code, err = _run_in_process(capsys, ["train", "--out", "/proc/no/such/dir"])
    assert code == 2 and "cannot create run directory" in err


@pytest.mark.timeout(30)
def test_resume_of_a_folder_without_config_json_is_refused_and_leaves_it_alone(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    code, err = _run_in_process(capsys, ["train", "--resume", str(tmp_path / "taken"), "--workers", "3"])
    assert code == 2 and "config.json does not exist; is this a diloco run directory?" in err
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["x"]


@pytest.mark.timeout(30)
def test_resume_with_an_edited_config_is_refused(tiny, tmp_path, capsys):
    from diloco.run.train import train

    run = tmp_path / "run"
    train(tiny(checkpoint_every=1, rounds=2, out=str(run)), stop_after=1, progress=False)
    config = json.loads((run / "config.json").read_text())
    config["model"]["d_model"] = 64
    (run / "config.json").write_text(json.dumps(config))
    code, err = _run_in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "does not match its config.json" in err
    # torch's multi-line state_dict error, one line: the first tensor that differs
    assert "size mismatch for" in err and err.count("\n") == 1


@pytest.mark.timeout(30)
def test_resume_with_a_metrics_file_cut_short_is_refused_before_writing(tiny, tmp_path, capsys):
    """Cutting metrics.jsonl back to the checkpoint's offset would pad a shorter file with NUL
    bytes: refused, and neither it nor config.json changes."""
    from diloco.run.train import train

    run = tmp_path / "run"
    train(tiny(checkpoint_every=1, rounds=2, out=str(run)), stop_after=1, progress=False)
    metrics = run / "metrics.jsonl"
    cut = metrics.read_bytes()[:10]
    metrics.write_bytes(cut)
    config = (run / "config.json").read_bytes()
    code, err = _run_in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "holds 10 bytes, but held" in err and err.count("\n") == 1
    assert metrics.read_bytes() == cut
    assert (run / "config.json").read_bytes() == config
    metrics.unlink()
    code, err = _run_in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "has no metrics.jsonl" in err  # checked earlier, with the run


@pytest.mark.timeout(60)
def test_real_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "train", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("diloco: error: num_workers (--workers)")
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "toml,needle",
    [
        ("out = 5", "out (--out) must be a string, got 5; set it to a string."),
        ("rounds = true", "rounds (--rounds) must be an integer, got True"),
        ('[inner]\nlr = "x"', "inner.lr (--inner-lr) must be a number, got 'x'"),
        ('[sim]\nspeeds = ["a"]', "sim.speeds (--speeds) must be a list of numbers, got ['a']"),
        ("[server]\ndylu = 1", "dylu.enabled (--dylu) must be true or false or unset, got 1"),
        ("[model]\nn_layer = 2.5", "model.n_layer must be an integer, got 2.5"),
        ('[sim]\nslowdowns = ["1:inf@0-10"]', "sim.slowdowns (--slowdown) must be W:FACTOR@START-END"),
        ('[sim]\nslowdowns = ["1:nan@0-10"]', "a finite FACTOR > 0"),
        ('on_nonfinite = "ignore"', "on_nonfinite (--on-nonfinite) must be one of stop, drop"),
        ("keep_checkpoints = 0\ncheckpoint_every = 1", "keep_checkpoints (--keep-checkpoints) must be"),
        ("timeout_s = 60", "timeout_s (--timeout-s) applies only with --runtime collective"),
        ("[async]\ngrace_s = 2.0", "async.grace_s (--grace-s) applies only with --method async"),
    ],
)
def test_a_toml_value_of_the_wrong_type_exits_2_naming_key_flag_and_type(
    tmp_path, monkeypatch, capsys, toml, needle
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(toml + "\n")
    code, err = _run_in_process(capsys, ["train", "--config", "c.toml"])
    assert code == 2 and needle in err, err
    assert err.startswith("diloco: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]  # no run directory


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--async-rule", "naive"], "async.rule (--async-rule) applies only with --method async"),
        (["--dn-buffer", "2"], "add --method async or drop it."),
        (["--dylu-alpha", "0.9", "--method", "dp"], "(this run has dp)"),
        (["--bucket-mb", "4"], "bucket_mb (--bucket-mb) applies only with --runtime collective"),
        (["--procs-per-worker", "2"], "set --runtime collective or server or drop it."),
        (["--timeout-s", "10"], "timeout_s (--timeout-s) applies only with --runtime collective"),
        (
            ["--runtime", "collective", "--speeds", "1,2"],
            "sim.speeds (--speeds) gives 2 speeds for 4 workers",
        ),
        (["--runtime", "collective", "--heterogeneity", "very"], "add --runtime sim or drop it."),
        (["--runtime", "collective", "--latency-ms", "5"], "sim.latency_ms (--latency-ms) applies only"),
        (["--runtime", "collective", "--procs", "2"], "sim.procs (--procs) applies only with --runtime sim"),
        (
            ["--runtime", "collective", "--timeout-s", "0"],
            "timeout_s (--timeout-s) must be a finite number > 0.0",
        ),
        (["--keep-checkpoints", "5"], "set --checkpoint-every above 0 or drop it."),
        (["--slowdown", "1:2@0-nan"], "sim.slowdowns (--slowdown) must be W:FACTOR@START-END"),
        (["--on-nonfinite", "skip"], "must be one of stop, drop, got 'skip'"),
        (["--codec", "fp8"], "must be one of fp32, bf16, int8, fp4, topk, got 'fp8'"),
        (["--topk-fraction", "0.1"], "topk_fraction (--topk-fraction) applies only with --codec topk"),
        (["--codec", "topk", "--topk-fraction", "0"], "topk_fraction (--topk-fraction) must be"),
        (["--codec", "topk", "--topk-bits", "4"], "topk_bits (--topk-bits) must be one of 2, 3, 32, got 4."),
        (
            ["--codec", "topk", "--topk-chunk", "-1"],
            "topk_chunk (--topk-chunk) must be an integer >= 0, got -1",
        ),
        (["--topk-chunk", "64"], "topk_chunk (--topk-chunk) applies only with --codec topk"),
        (["--outer-opt", "sparseloco", "--codec", "fp4"], "it needs --codec topk with --error-feedback"),
        (["--method", "async", "--outer-opt", "sparseloco"], "use --method diloco, not async"),
        (["--ef-decay", "0.9"], "ef_decay (--ef-decay) applies only with --error-feedback"),
        (["--outer-opt", "sparseloco", "--ef-decay", "0"], "ef_decay (--ef-decay) must be"),
        (["--error-feedback"], "fp32 leaves out nothing; set --codec other than fp32 or drop it."),
        (["--download-codec", "fp4"], "must be one of fp32, bf16, got 'fp4'"),
        (["--method", "dp", "--codec", "int8"], "--method dp sends none of them: drop it."),
        (["--method", "single", "--download-codec", "bf16"], "download_codec (--download-codec) encodes"),
        (["--overlap-steps", "2", "--mix-alpha", "1"], "mix_alpha (--mix-alpha) must be"),
        (["--fragments", "5"], "the model has 4 blocks to split; use at most 4."),
        (["--fragments", "2", "--overlap-steps", "25"], "must be below inner_steps / fragments = 25"),
        (["--mix-alpha", "0.3"], "set --overlap-steps above 0 or drop it."),
        (
            ["--method", "async", "--fragments", "2"],
            "fragments (--fragments) applies only with --method diloco",
        ),
        (["--fragments", "2", "--drop-prob", "0.1"], "does not simulate lost outer_grads"),
        (
            ["--after-drop", "global"],
            "applies only with --drop-prob above 0 (this run has 0.0): it says what a dropped",
        ),
        (["--drop-prob", "0.1", "--after-drop", "mine"], "must be one of own, global, got 'mine'"),
        (  # the method first: --drop-prob is refused with async too
            ["--method", "async", "--after-drop", "global"],
            "after_drop (--after-drop) applies only with --method diloco (this run has async)",
        ),
        (["--overlap-steps", "2", "--on-nonfinite", "drop"], "use --on-nonfinite stop"),
    ],
)
def test_a_flag_that_does_not_apply_exits_2(tmp_path, monkeypatch, capsys, flags, needle):
    monkeypatch.chdir(tmp_path)
    code, err = _run_in_process(capsys, ["train", *flags])
    assert code == 2 and needle in err, err
    assert err.startswith("diloco: error:") and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
def test_resume_with_new_threads_and_procs_finishes_the_run(tiny, tmp_path, capsys):
    from diloco.run.train import train

    run, straight = tmp_path / "run", tmp_path / "straight"
    train(tiny(checkpoint_every=1, rounds=2, out=str(run)), stop_after=1, progress=False)
    train(tiny(checkpoint_every=1, rounds=2, out=str(straight)), progress=False)
    code, err = _run_in_process(capsys, ["train", "--resume", str(run), "--threads", "2", "--procs", "2"])
    assert code == 0, err
    a, b = (json.loads((d / "summary.json").read_text()) for d in (run, straight))
    assert a["val_loss"] == b["val_loss"]  # neither threads nor processes change a result


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["0", "6", "9"])
def test_a_stop_after_that_would_not_stop_is_refused(tmp_path, capsys, value):
    code, err = _run_in_process(capsys, ["train", "--out", str(tmp_path / "r"), "--stop-after", value])
    assert (
        code == 2 and f"--stop-after must be a round from 1 to 5 (the run has 6 rounds), got {value}" in err
    )
    assert not (tmp_path / "r").exists()


def test_a_diverged_but_finite_loss_prints_and_saves_without_overflow():
    from diloco.rundir.metrics import json_safe, perplexity
    from diloco.rundir.summary import format_summary

    summary = {
        "wall_time_s": 1.0,
        "sim_time_s": 2.0,
        "run_dir": "r",
        "val_loss": 1e4,
        "val_ppl": perplexity(1e4),
        "tokens": 1,
        "inner_steps": 1,
        "inner_steps_per_worker": [1],
        "num_workers": 1,
        "outer_updates": 1,
        "method": "diloco",
        "bytes_sent_per_worker": 8,
        "dp_bytes_ratio": 2.0,
        "dp_bytes_sent_per_worker": 16,
        "target_loss": None,
    }
    assert "val_loss 10000.0000   val_ppl overflow" in format_summary(summary)
    assert json.loads(json.dumps(json_safe(summary), allow_nan=False))["val_ppl"] is None


@pytest.mark.timeout(60)
def test_a_checkpoint_of_the_earlier_layout_is_refused_in_one_sentence(tiny, tmp_path, capsys):
    from diloco.run.train import train
    from diloco.rundir import checkpoint

    run = tmp_path / "run"
    train(tiny(checkpoint_every=1, rounds=2, out=str(run)), stop_after=1, progress=False)
    path, state = checkpoint.latest_valid(run / "checkpoints")
    del state["format"]  # what a checkpoint of the layout before issue 7 lacks
    checkpoint.save(run / "checkpoints", 1, state)
    before = (run / "metrics.jsonl").read_bytes()
    code, err = _run_in_process(capsys, ["train", "--resume", str(run)])
    assert code == 2 and "was written by an older diloco (checkpoint format 1" in err and err.count("\n") == 1
    assert (run / "metrics.jsonl").read_bytes() == before


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args,needle",
    [
        (["train", "--runtime", "server"], "started by diloco serve"),
        (["serve", "--runtime", "sim"], "diloco serve is the server runtime"),
        (["serve", "--method", "dp"], "runs --method diloco or async, not dp"),
        (["serve", "--drop-prob", "0.1"], "the parameter server has for real"),
        (["serve", "--method", "async", "--dylu-oracle"], "a real runtime does not have"),
        (["serve", "--speeds", "1,2,3,4"], "applies only with --runtime sim"),
        (["serve", "--worker-timeout-s", "0"], "--worker-timeout-s) must be a finite number > 0.0"),
        (["serve", "--port", "70000"], "--port must be from 0 to 65535"),
        (["serve", "--http-port", "-5"], "--http-port must be from 0 to 65535, or -1"),
        (["serve", "--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["serve", "--token-file", "missing.txt"], "missing.txt is not a file"),
        (["serve", "--max-staleness", "3"], "a sync round's outer_grads are never stale"),
        (["serve", "--fragments", "2", "--max-update-norm-ratio", "4"], "compares whole outer_grads"),
        (["serve", "--method", "async", "--fragments", "2"], "asynchronous workers have no common rounds"),
        (["serve", "--max-update-norm-ratio", "0.5"], "give a number above 1"),
        (["serve", "--method", "async", "--max-staleness", "-1"], "--max-staleness) must be an integer >= 0"),
        (
            ["serve", "--max-inflight-downloads", "0"],
            "--max-inflight-downloads) must be an integer >= 1, got 0",
        ),
        (["serve", "--max-inflight-pushes", "-1"], "--max-inflight-pushes) must be an integer >= 0, got -1"),
        (["worker", "--server", "localhost:1", "--tls-ca", "missing.pem"], "missing.pem is not a file"),
        (["train", "--round-timeout-s", "5"], "run it with diloco serve (docs/server.md), or drop it"),
        (["worker", "--server", "localhost:1", "--threads", "0"], "needs --threads >= 1"),
        (["worker", "--server", "localhost"], "'localhost' is not HOST:PORT"),
        (["worker", "--server", "127.0.0.1:99999"], "with a port from 1 to 65535"),
        pytest.param(
            ["worker", "--server", "localhost:1", "--device", "cuda:0"],
            "use --device cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
        (["replay", "nowhere"], "run directory nowhere does not exist"),
    ],
)
def test_bad_server_input_exits_2_with_one_sentence(tmp_path, monkeypatch, capsys, args, needle):
    monkeypatch.chdir(tmp_path)
    extra = ["--out", str(tmp_path / "out")] if args[0] in ("train", "serve") else []
    code, err = _run_in_process(capsys, [*args, *extra])
    assert code == 2, err
    assert needle in err
    assert err.startswith("diloco: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _user_inputs(tmp_path):
    """Files for the bad inputs of `--data`, `--tokenizer` and `--model-config`."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.bin").write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    (tmp_path / "nofield.jsonl").write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    (tmp_path / "tok.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 300}))
    (tmp_path / "small-vocab.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    (tmp_path / "short.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 16}))
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))  # 1,024 positions
    (tmp_path / "tiny.txt").write_text("A short text. " * 400)
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "badline.jsonl").write_text('{"text": "fine"}\n{"text": "a raw\tcontrol character"}\n')


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--data", "nowhere.txt"], "nowhere.txt does not exist; check the path given to --data"),
        (["--data", "emptydir"], "emptydir"),
        (["--data", "empty.txt"], "empty.txt has no text"),
        (["--data", "binary.bin"], "binary.bin is a binary file"),
        (["--data", "latin1.txt"], "latin1.txt is not UTF-8 text (invalid byte at offset 3)"),
        (["--data", "nofield.jsonl"], "nofield.jsonl:2"),
        (["--tokenizer", "tok.json"], "tok.json"),
        (["--tokenizer", "bpe:abc"], "bpe:abc"),
        (["--model-config", "bert.json"], "not a causal LM"),
        (
            ["--model-config", "short.json", "--model", "micro"],
            "model.name (--model) is a setting of diloco's GPT",
        ),
        (["--data", "tiny.txt", "--source-field", "genre"], "add that or drop it"),
        (["--model-config", "small-vocab.json"], "vocab_size is 100 but the tokenizer (byte) has 256"),
        (["--model-config", "short.json", "--seq-len", "32"], "allows 16 positions but --seq-len is 32"),
        (["--model-config", "gpt2.json", "--seq-len", "2048"], "allows 1024 positions but --seq-len is 2048"),
        (["--data", "tiny.txt", "--workers", "8"], "fewer than 8 i.i.d. shards need (one each); give more"),
        (["--data", "tiny.txt", "--shards", "kmeans", "--workers", "2"], "text makes 1 for 2 workers"),
        (["--model-config", "latin1.txt"], "model config latin1.txt is not text"),
        (["--data", "badline.jsonl"], "badline.jsonl:2 is not valid JSON (Invalid control character at col"),
        (["--data", "tiny.txt", "--shards", "genre"], "use --shards by-source"),
        (["--text-field", "body"], "add --data PATH"),
        (["--data", "tiny.txt", "--val-data", "tiny.txt", "--val-fraction", "0.1"], "give one of them"),
        (["--eval-on", "tune"], "needs --tune-fraction above 0"),
        (["--tune-fraction", "0.5"], "--tune-fraction"),
    ],
)
def test_bad_user_data_tokenizer_or_model_exits_2_and_writes_nothing(
    tmp_path, monkeypatch, capsys, flags, needle
):
    _user_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code, err = _run_in_process(capsys, ["train", *flags, "--out", str(out), "--no-progress"])
    assert code == 2, err
    assert needle in err
    assert err.startswith("diloco: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "runs").exists()


def _smallest_run(tmp_path, rounds: int) -> list[str]:
    """Flags of a one-worker run of a one-block GPT that takes well under a second."""
    (tmp_path / "tiny.toml").write_text("[model]\nn_layer = 1\nn_head = 2\nd_model = 16\n")
    flags = ["--config", "tiny.toml", "--seq-len", "16", "--batch-size", "2", "--inner-steps", "2"]
    return [*flags, "--rounds", str(rounds), "--workers", "1", "--procs", "1", "--no-progress"]


@pytest.mark.timeout(60)
def test_init_from_a_run_with_another_vocabulary_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = _smallest_run(tmp_path, rounds=1)
    assert main(["train", *small, "--out", "bytes"]) == 0
    capsys.readouterr()
    code, err = _run_in_process(
        capsys, ["train", *small, "--tokenizer", "bpe:300", "--init-from", "bytes", "--out", "x"]
    )
    assert code == 2 and "has a vocabulary of 256" in err and "have 300" in err and "--tokenizer" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.timeout(60)
def test_eval_generate_and_export_refuse_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = [*_smallest_run(tmp_path, rounds=2), "--checkpoint-every", "1"]
    assert main(["train", *small, "--out", "run", "--stop-after", "1"]) == 0
    code, err = _run_in_process(capsys, ["eval", "run"])
    assert code == 2 and "has not finished" in err and "--resume run" in err
    assert main(["train", "--resume", "run", "--no-progress"]) == 0
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    code, err = _run_in_process(capsys, ["eval", "run", "--data", "latin1.txt"])
    assert code == 2 and "latin1.txt is not UTF-8" in err
    code, err = _run_in_process(capsys, ["generate", "run", "--prompt", "x", "--temperature", "-1"])
    assert code == 2 and "--temperature must be a finite number >= 0, got -1.0" in err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep").write_text("mine")
    code, err = _run_in_process(capsys, ["export", "run", "taken"])
    assert code == 2 and "not empty" in err and (tmp_path / "taken" / "keep").read_text() == "mine"
    code, err = _run_in_process(capsys, ["eval", "nowhere"])
    assert code == 2 and "nowhere does not exist" in err
    shutil.copytree(tmp_path / "run", tmp_path / "wider")  # weights of another model size
    config = json.loads((tmp_path / "wider" / "config.json").read_text())
    config["model"]["d_model"] = 32
    (tmp_path / "wider" / "config.json").write_text(json.dumps(config))
    code, err = _run_in_process(capsys, ["export", "wider", "exported"])
    assert code == 2 and "size mismatch for" in err and err.count("\n") == 1
    assert not (tmp_path / "exported").exists()
    (tmp_path / "wider" / "config.json").write_text("[]")
    code, err = _run_in_process(capsys, ["eval", "wider"])
    assert code == 2 and "config.json holds a JSON list, not an object" in err and err.count("\n") == 1


@pytest.mark.timeout(60)
def test_plot_leaves_out_a_line_cut_off_mid_write_and_refuses_a_corrupt_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *_smallest_run(tmp_path, rounds=2), "--out", "run"]) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"kind": "eval", "inner_st')  # a writer killed mid-line
    assert main(["plot", "run", "--out", "cut.png"]) == 0 and (tmp_path / "cut.png").is_file()
    lines = whole.splitlines(keepends=True)
    metrics.write_text("".join([lines[0], "garbage{not json\n", *lines[1:]]))
    capsys.readouterr()
    assert main(["plot", "run", "--out", "bad.png"]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:2 is not a metrics line" in err and err.count("\n") == 1
    assert not (tmp_path / "bad.png").exists()
