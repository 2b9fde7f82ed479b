"""Shared fixtures: tiny configs that run the real code paths in seconds on one CPU thread."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diloco.config import DataConfig, InnerConfig, ModelConfig, SimConfig, TrainConfig

torch.set_num_threads(1)


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


@pytest.fixture
def tiny(tmp_path):
    return lambda **kw: tiny_config(tmp_path, **kw)
