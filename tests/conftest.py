"""Shared fixtures: tiny configs that run the real code paths in seconds on one CPU thread."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import signal
import tempfile

import pytest
import torch

from diloco.config import DataConfig, InnerConfig, ModelConfig, SimConfig, TrainConfig

torch.set_num_threads(1)

# A shell without job control starts background commands with Ctrl-C ignored, and the processes the
# tests start would inherit that and ignore the SIGINTs the tests send them: restore the default.
signal.signal(signal.SIGINT, signal.default_int_handler)

# Tokenised data is cached (tokens.py): the tests keep theirs apart from the user's, for this
# session (processes the tests start inherit it).
os.environ["DILOCO_CACHE"] = tempfile.mkdtemp(prefix="diloco-test-cache-")
atexit.register(shutil.rmtree, os.environ["DILOCO_CACHE"], ignore_errors=True)


def benchmark_module(name: str):
    """benchmarks/<name>.py loaded as a module (benchmarks/ is no package), registered under its
    name first: its dataclasses look their module up there."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    """The real default config shrunk to a model and batch that train in well under a second."""
    base = TrainConfig(
        num_workers=2,
        inner_steps=4,
        rounds=3,
        eval_every=4,
        out=str(tmp_path / "run"),
        model=ModelConfig(name="nano", n_layer=2, n_head=2, d_model=32, seq_len=32),
        data=DataConfig(batch_size=4, eval_windows=16),
        inner=InnerConfig(warmup_steps=2),
        threads=1,
        sim=SimConfig(procs=1),
    )
    return dataclasses.replace(base, **overrides)


# A Llama small enough to train in a second, built by transformers from this config (no weights).
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def user_files(folder) -> tuple[str, str]:
    """A small jsonl corpus (80 documents) and the tiny Llama's config.json in `folder`: their paths."""
    import json

    docs = [
        json.dumps({"text": f"Document {i}: " + "to be or not to be, " * (20 + i % 7)}) for i in range(80)
    ]
    (folder / "d.jsonl").write_text("\n".join(docs) + "\n")
    (folder / "llama.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder / "d.jsonl"), str(folder / "llama.json")


@pytest.fixture
def tiny(tmp_path):
    return lambda **kw: tiny_config(tmp_path, **kw)


def check_summary(summary: dict, run_dir, tokens_per_step: int, inner_steps: int) -> None:
    """summary.json's figures and its printed lines add up, with each other and with metrics.jsonl
    (docs/server.md, "The summary"): inner steps per worker from what arrived, tokens from those
    steps, "per worker" as the mean over the k workers on every figure of the bytes line, and the
    compute utilisation as the rounds' (sync) or the workers' rows (async)."""
    import re

    from diloco.rundir.metrics import read_metrics
    from diloco.rundir.summary import format_summary

    k, each = summary["num_workers"], summary["inner_steps_per_worker"]
    assert len(each) == k and summary["inner_steps"] == sum(each)
    assert summary["tokens"] == summary["inner_steps"] * tokens_per_step
    lines = read_metrics(run_dir)
    assert lines[-1]["tokens"] == summary["tokens"]
    steps = [0] * k  # per worker, from the metrics: async `worker` lines, sync `inner` lines (H each)
    for m in lines:
        if m["kind"] in ("inner", "worker"):
            steps[m["worker"]] += m.get("steps", inner_steps)
    assert steps == each
    assert summary["bytes_sent_per_worker"] == round(summary["bytes_sent"] / k)
    dp = round(summary["inner_steps"] * summary["params"] * 4 / k)
    assert summary["dp_bytes_sent_per_worker"] == dp
    assert summary["dp_bytes_ratio"] == pytest.approx(dp / summary["bytes_sent_per_worker"])
    printed = format_summary(summary)
    shown = "/".join(f"{n:,}" for n in each) if len(set(each)) > 1 else f"{each[0]:,}"
    assert f"inner steps {summary['inner_steps']:,} ({shown} per worker)" in printed
    found = re.search(r"per worker ([\d.]+) MB \(mean of \d+\): ([\d.]+)x fewer .* \(([\d.]+) MB\)", printed)
    sent_mb, ratio, dp_mb = map(float, found.groups())  # each rounded as printed
    assert (dp_mb - 0.005) / (sent_mb + 0.005) - 0.05 <= ratio <= (dp_mb + 0.005) / (sent_mb - 0.005) + 0.05
    rows = summary.get("workers")
    if rows:
        assert [r["inner_steps"] for r in rows] == each
    # the training part's compute ÷ wall time, one definition: sync rounds as measured, else
    # (the async server) the workers' rows, computing ÷ first job handed out to last push
    outer = [m for m in lines if m["kind"] == "outer" and "compute_s" in m]
    if outer:
        compute, wall = sum(m["compute_s"] for m in outer), sum(m["compute_s"] + m["comm_s"] for m in outer)
    elif rows:
        compute, wall = sum(r["compute_s"] for r in rows), sum(r["train_s"] for r in rows)
        shares = [r["compute_utilisation"] for r in rows if r["compute_utilisation"] is not None]
        assert min(shares) - 1e-3 <= summary["compute_utilisation"] <= max(shares) + 1e-3
    if outer or rows:
        assert summary["compute_utilisation"] == pytest.approx(compute / wall, abs=2e-4)
        assert f"compute utilisation {summary['compute_utilisation']:.1%}" in printed
