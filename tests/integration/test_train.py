"""`diloco train` end to end: run files, determinism, resume bit for bit, bad input."""

import dataclasses
import json
import subprocess
import sys

import pytest
from conftest import check_summary
from safetensors.torch import load_file

from diloco.run.train import train
from diloco.rundir.metrics import read_metrics

RUN_FILES = {"config.json", "metrics.jsonl", "summary.json", "model.safetensors"}
TIMES = ("wall_time_s", "eval_time_s")


def _same_params(a, b):
    pa, pb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return pa.keys() == pb.keys() and all(pa[k].equal(pb[k]) for k in pa)


def _strip(summary):
    return {k: v for k, v in summary.items() if k not in TIMES + ("run_dir",)}


@pytest.mark.timeout(180)  # ~30 s beside one busy process; 60 s was too little beside several
def test_cli_run_writes_every_file_and_validation_loss_falls(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diloco",
            "train",
            "--workers",
            "2",
            "--inner-steps",
            "10",
            "--rounds",
            "4",
            "--batch-size",
            "8",
            "--seq-len",
            "64",
            "--eval-every",
            "10",
            "--inner-lr",
            "3e-3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr
    assert "x fewer than data parallel" in proc.stdout
    files = {p.name for p in out.iterdir()}
    assert RUN_FILES <= files and any(f.startswith("events.out.tfevents") for f in files)
    lines = read_metrics(out)
    assert {line["kind"] for line in lines} == {"inner", "outer", "eval"}
    for line in lines:
        assert {"kind", "version", "inner_step", "tokens", "wall_time_s", "sim_time_s"} <= line.keys()
    evals = [line["val_loss"] for line in lines if line["kind"] == "eval" and line["split"] == "subset"]
    assert len(evals) == 5 and evals[-1] < evals[0] - 0.5
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "val_loss",
        "val_ppl",
        "tokens",
        "inner_steps",
        "outer_updates",
        "bytes_sent",
        "bytes_received",
        "wall_time_s",
    ):
        assert key in summary
    assert summary["outer_updates"] == 4 and summary["inner_steps"] == 80
    assert summary["dp_bytes_ratio"] == pytest.approx(10.0)
    assert json.loads((out / "config.json").read_text())["num_workers"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["diloco", "dp", "single"])
def test_same_seed_twice_is_bit_identical(tiny, tmp_path, method):
    a = train(tiny(method=method, out=str(tmp_path / "a")), progress=False)
    b = train(tiny(method=method, out=str(tmp_path / "b")), progress=False)
    assert _strip(a) == _strip(b)
    assert _same_params(tmp_path / "a", tmp_path / "b")
    train(tiny(method=method, seed=1, out=str(tmp_path / "c")), progress=False)
    assert not _same_params(tmp_path / "a", tmp_path / "c")


@pytest.mark.timeout(90)
def test_resume_continues_bit_for_bit(tiny, tmp_path):
    straight = tmp_path / "straight"
    resumed = tmp_path / "resumed"
    full = train(tiny(rounds=6, out=str(straight)), progress=False)
    stopped = train(tiny(rounds=6, checkpoint_every=2, out=str(resumed)), stop_after=3, progress=False)
    assert stopped == {"stopped_after": 3, "run_dir": str(resumed)}
    assert not (resumed / "summary.json").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "train", "--resume", str(resumed)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    again = json.loads((resumed / "summary.json").read_text())
    assert _strip(again) == _strip(full)
    assert _same_params(straight, resumed)
    # metrics.jsonl holds every round once, as the uninterrupted run's does
    strip = [{k: v for k, v in line.items() if k not in TIMES} for line in read_metrics(resumed)]
    assert strip == [{k: v for k, v in line.items() if k not in TIMES} for line in read_metrics(straight)]


@pytest.mark.timeout(30)
def test_non_iid_weights_reach_the_outer_step(tiny):
    from diloco.data.recipe import prepare_data
    from diloco.run.assemble import build_trainer

    cfg = tiny(data=dataclasses.replace(tiny().data, shards="kmeans"), num_workers=3)
    data = prepare_data(cfg)
    trainer = build_trainer(cfg, data)
    sizes = [len(s) for s in data.shards]
    assert trainer.weights == pytest.approx([n / sum(sizes) for n in sizes])
    assert len(set(sizes)) > 1
    trainer.close()


@pytest.mark.timeout(60)
def test_with_a_worker_dropping_out_the_summary_counts_each_workers_steps(tiny):
    # 3 workers for rounds 1-2, 2 for rounds 3-4 (worker 2 drops out), a third of the outer_grads
    # dropped on arrival: workers 0 and 1 ran 20 steps, worker 2 10
    cfg = tiny(
        num_workers=3, workers_schedule="0:3,0.5:2", drop_prob=0.3, inner_steps=5, rounds=4, eval_every=0
    )
    summary = train(cfg, progress=False)
    assert summary["inner_steps_per_worker"] == [20, 20, 10] and summary["inner_steps"] == 50
    assert summary["dp_bytes_ratio"] == pytest.approx(5.0, rel=1e-3)  # H: one message per 5 steps
    check_summary(summary, cfg.out, tokens_per_step=4 * 32, inner_steps=5)


@pytest.mark.timeout(60)
def test_shard_tokens_and_weights_are_in_the_summary_and_small_shards_are_warned_of(tiny, tmp_path, capsys):
    from diloco.data.recipe import prepare_data

    for name, lines in (("a.txt", 600), ("b.txt", 300)):  # two sources, ~24K and ~12K tokens
        (tmp_path / name).write_text("".join(f"{name} line {i}: to be or not to be\n" for i in range(lines)))
    data = dataclasses.replace(
        tiny().data,
        paths=(str(tmp_path / "a.txt"), str(tmp_path / "b.txt")),
        shards="by-source",
        batch_size=16,
    )
    cfg = tiny(data=data, inner_steps=50, rounds=1, eval_every=0)  # a round reads 50 × 16 × 32 tokens
    summary = train(cfg, progress=False)
    shards = prepare_data(cfg).shards
    assert [s["tokens"] for s in summary["shards"]] == [len(s) for s in shards]
    total = sum(map(len, shards))
    assert [s["weight"] for s in summary["shards"]] == pytest.approx([len(s) / total for s in shards])
    assert len(shards[0]) > 1.5 * len(shards[1])
    err = capsys.readouterr().err
    assert (
        "diloco: warning: 2 of 2 shards hold fewer tokens than their worker reads in a round (25,600)" in err
    )
    assert f"worker 1 {len(shards[1]):,} (weight {summary['shards'][1]['weight']:.4f})" in err
    train(tiny(data=dataclasses.replace(data, batch_size=4), out=str(tmp_path / "b")), progress=False)
    assert "warning" not in capsys.readouterr().err  # a round reads 4 × 4 × 32 tokens


@pytest.mark.timeout(60)
def test_data_parallel_writes_one_inner_line_per_round_for_the_whole_batch(tiny):
    cfg = tiny(method="dp", num_workers=3)
    summary = train(cfg, progress=False)
    inner = [m for m in read_metrics(cfg.out) if m["kind"] == "inner"]
    assert [(m["inner_step"], m["worker"]) for m in inner] == [(4, 0), (8, 0), (12, 0)]
    assert inner[-1]["bytes_sent"] == summary["bytes_sent_per_worker"] == 12 * summary["params"] * 4


@pytest.mark.timeout(120)
def test_a_tuning_run_trains_the_same_and_scores_the_tuning_split(tmp_path, capsys, monkeypatch):
    """--eval-on tune changes what the evaluations score, not what is trained: two runs holding
    the same tuning split out end with the same parameters, and only the tuning run's summary
    names the split its val_loss scored."""
    from diloco.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text("[model]\nn_layer = 1\nn_head = 2\nd_model = 16\n")
    flags = ["--config", "tiny.toml", "--seq-len", "16", "--batch-size", "2", "--inner-steps", "2"]
    flags += ["--rounds", "2", "--workers", "2", "--procs", "1", "--no-progress", "--tune-fraction", "0.05"]
    assert main(["train", *flags, "--out", "val"]) == 0
    assert main(["train", *flags, "--eval-on", "tune", "--out", "tune"]) == 0
    out = capsys.readouterr().out
    assert "(whole tuning split)" in out and "(whole validation split)" in out
    assert _same_params(tmp_path / "val", tmp_path / "tune")
    val, tune = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("val", "tune"))
    assert tune["eval_split"] == "tune" and "eval_split" not in val
    assert tune["val_loss"] != val["val_loss"]
