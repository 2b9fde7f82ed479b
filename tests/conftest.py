"""Shared fixtures: tiny configs that run the real code paths in seconds on one CPU thread."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile

import pytest
import torch

from diloco.config import DataConfig, InnerConfig, ModelConfig, SimConfig, TrainConfig

torch.set_num_threads(1)

# Tokenised data is cached (tokens.py): the tests keep theirs apart from the user's, for this
# session (processes the tests start inherit it).
os.environ["DILOCO_CACHE"] = tempfile.mkdtemp(prefix="diloco-test-cache-")
atexit.register(shutil.rmtree, os.environ["DILOCO_CACHE"], ignore_errors=True)


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
