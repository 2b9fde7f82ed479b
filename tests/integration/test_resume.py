"""Checkpoints in every runtime and method: async runs stop and resume bit for bit, and a
checkpoint written by one runtime resumes in the other (simulator <-> torchrun)."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from diloco.cli.main import main

TOML = "[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n"
TINY = ["--seq-len", "32", "--batch-size", "4", "--inner-steps", "4", "--threads", "1"]


def _config(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TOML)
    return ["--config", str(path), *TINY]


def _params(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _equal(a, b):
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


ASYNC = ["--method", "async", "--heterogeneity", "very", "--rounds", "4", "--procs", "1"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--async-rule", "buffer", "--grace-s", "1.5", "--no-shard-sampling", "--async-rule", "delaycomp"],
        ["--grace-s", "inf", "--async-rule", "buffer"],  # config.json holds "inf" (JSON has no infinity)
        ["--grace-s", "measured", "--dylu-by", "steps", "--speed-jitter", "0.2"],  # the arrivals are saved
    ],
    ids=["paper-form", "delaycomp-grace", "unbounded-grace", "measured-grace"],
)
def test_async_stop_after_and_resume_ends_bit_identical(tmp_path, capsys, extra):
    flags = [*_config(tmp_path), *ASYNC, "--workers", "3", *extra]
    assert main(["train", *flags, "--out", str(tmp_path / "straight")]) == 0
    assert (
        main(["train", *flags, "--checkpoint-every", "1", "--stop-after", "2", "--out", str(tmp_path / "r")])
        == 0
    )
    assert "continue with: diloco train --resume" in capsys.readouterr().out
    stopped = _metrics(tmp_path / "r")
    assert not (tmp_path / "r" / "summary.json").exists()
    assert main(["train", "--resume", str(tmp_path / "r")]) == 0
    assert _equal(_params(tmp_path / "straight"), _params(tmp_path / "r"))
    a, b = _summary(tmp_path / "straight"), _summary(tmp_path / "r")
    for key in ("val_loss", "outer_updates", "sim_time_s", "bytes_sent", "tokens", "inner_steps"):
        assert a[key] == b[key], key
    # the resumed run's metrics are the straight run's, but for wall time (nothing lost or doubled)
    strip = lambda lines: [{k: v for k, v in x.items() if k != "wall_time_s"} for x in lines]  # noqa: E731
    assert strip(_metrics(tmp_path / "r")) == strip(_metrics(tmp_path / "straight"))
    assert len(stopped) < len(_metrics(tmp_path / "r"))
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == [
        "round-000001",
        "round-000002",
        "round-000003",
    ]  # --keep-checkpoints 3: round 0 is gone


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra",
    [
        ["--codec", "fp4", "--error-feedback"],
        ["--codec", "topk", "--topk-fraction", "0.2", "--error-feedback", "--download-codec", "bf16"],
        [
            "--fragments",
            "2",
            "--overlap-steps",
            "1",
            "--codec",
            "int8",
            "--error-feedback",
            "--speeds",
            "1,2",
        ],
        pytest.param(
            [
                "--fragments",
                "2",
                "--codec",
                "fp4",
                "--error-feedback",
                "--procs",
                "2",
                "--bandwidth-mbps",
                "1",
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["fp4-ef", "topk-ef-bf16-download", "streaming-overlap-int8", "streaming-two-procs"],
)
def test_codec_state_and_streaming_stop_and_resume_bit_identical(tmp_path, capsys, extra):
    """What error feedback kept, each fragment's outer optimizer and the workers' own clocks
    are in the checkpoint: a stopped and resumed run ends as the straight one."""
    flags = [*_config(tmp_path), "--workers", "2", "--rounds", "4", *extra]
    flags += [] if "--procs" in extra else ["--procs", "1"]
    assert main(["train", *flags, "--out", str(tmp_path / "straight")]) == 0
    stop = ["--checkpoint-every", "1", "--stop-after", "2", "--out", str(tmp_path / "r")]
    assert main(["train", *flags, *stop]) == 0
    assert main(["train", "--resume", str(tmp_path / "r")]) == 0
    assert _equal(_params(tmp_path / "straight"), _params(tmp_path / "r"))
    a, b = _summary(tmp_path / "straight"), _summary(tmp_path / "r")
    for key in ("val_loss", "outer_updates", "sim_time_s", "bytes_sent", "bytes_received"):
        assert a[key] == b[key], key
    capsys.readouterr()


@pytest.mark.timeout(60)
def test_an_async_checkpoint_of_an_older_diloco_is_refused_with_one_sentence(tmp_path, capsys):
    flags = [*_config(tmp_path), *ASYNC, "--workers", "2", "--checkpoint-every", "1", "--stop-after", "1"]
    assert main(["train", *flags, "--out", str(tmp_path / "r")]) == 0
    from diloco.rundir import checkpoint

    checkpoints = tmp_path / "r" / "checkpoints"
    state = checkpoint.load(checkpoint.latest(checkpoints))  # round 1, the one --resume takes
    del state["trainer"]["runtime"]["async"]["probes"]  # what a checkpoint before issue 8 lacks
    checkpoint.save(checkpoints, 1, state, keep=None)
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "written by an older diloco, before first jobs probed their speed" in err and err.count("\n") == 1


def _torchrun(tmp_path, *flags, env=None, timeout=100):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "diloco", "train", *flags]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env={**os.environ, **(env or {})}
    )


@pytest.mark.slow  # long; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(200)
def test_a_checkpoint_moves_between_the_simulator_and_torchrun_both_ways(tmp_path):
    flags_c = [*_config(tmp_path), "--workers", "2", "--rounds", "4"]
    flags = [*flags_c, "--procs", "1"]
    assert main(["train", *flags, "--out", str(tmp_path / "straight")]) == 0
    # simulator -> torchrun
    assert (
        main(["train", *flags, "--checkpoint-every", "1", "--stop-after", "2", "--out", str(tmp_path / "a")])
        == 0
    )
    proc = _torchrun(tmp_path, "--resume", str(tmp_path / "a"), "--runtime", "collective")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # torchrun -> simulator
    proc = _torchrun(
        tmp_path,
        "--runtime",
        "collective",
        "--timeout-s",
        "120",  # a collective-only setting: reset when the run moves to the simulator
        *flags_c,
        "--checkpoint-every",
        "1",
        "--stop-after",
        "2",
        "--out",
        str(tmp_path / "b"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["train", "--resume", str(tmp_path / "b"), "--runtime", "sim"]) == 0
    straight = _summary(tmp_path / "straight")
    for name, runtime in (("a", "collective"), ("b", "sim")):
        moved = _summary(tmp_path / name)
        assert moved["runtime"] == runtime
        assert moved["val_loss"] == straight["val_loss"], name  # 2 ranks: the same sums, bit for bit
        assert _equal(_params(tmp_path / name), _params(tmp_path / "straight")), name
        assert moved["outer_updates"] == 4 and moved["bytes_sent"] == straight["bytes_sent"]
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["runtime"] == runtime  # config.json records where the run went on


@pytest.mark.timeout(120)
def test_a_kmeans_run_resumed_where_k_means_differs_keeps_its_recorded_shards(tmp_path, capsys, monkeypatch):
    """The run records its shard plan (shards.json) and --resume cuts the shards by it, so a run
    resumed where k-means comes out otherwise (here: its clusters in reverse order, as another
    machine's might) ends bit for bit as it would have; a plan made for other settings is refused."""
    import dataclasses

    from diloco.data import shards as data
    from diloco.data.shard_plan import ShardPlan

    flags = [*_config(tmp_path), "--shards", "kmeans", "--workers", "2", "--rounds", "2", "--procs", "1"]
    assert main(["train", *flags, "--out", str(tmp_path / "straight")]) == 0
    stop = ["--checkpoint-every", "1", "--stop-after", "1", "--out", str(tmp_path / "r")]
    assert main(["train", *flags, *stop]) == 0
    recorded = (tmp_path / "r" / "shards.json").read_text()
    assert recorded == (tmp_path / "straight" / "shards.json").read_text()
    plan = ShardPlan.from_json(recorded, "r")
    assert plan.kind == "kmeans" and len(plan.groups) == 2 and sum(plan.tokens) > 4_000_000

    own = data.kmeans_groups
    monkeypatch.setattr(data, "kmeans_groups", lambda texts, k, seed: own(texts, k, seed)[::-1])
    (tmp_path / "r" / "shards.json").write_text(dataclasses.replace(plan, seed=1).to_json())
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert (
        "is for kmeans shards of 2 workers (seed 1), but the run has kmeans shards of 2 workers (seed 0)"
        in err
    )
    assert err.count("\n") == 1 and "Traceback" not in err
    (tmp_path / "r" / "shards.json").write_text(recorded)
    assert main(["train", "--resume", str(tmp_path / "r")]) == 0
    assert _equal(_params(tmp_path / "r"), _params(tmp_path / "straight"))
