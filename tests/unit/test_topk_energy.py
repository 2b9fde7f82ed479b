"""benchmarks/topk_energy.py's measures against hand computations: the share of energy in the
top-k of each chunk (as the top-k codec keeps it), and the per-round mean over workers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def te():
    spec = importlib.util.spec_from_file_location("topk_energy", BENCH / "topk_energy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(30)
def test_top_share_takes_the_top_of_each_chunk(te):
    """Two chunks of 4,096 (and a third of 100): the first all 1s but one 10, the second all 0s
    but four 3s, the third all 2s. At 1% a chunk of 4,096 keeps ⌈40.96⌉ = 41 values and one of
    100 keeps 1: 100 + 40·1 from the first, 4·9 from the second, 4 from the third, out of
    (100 + 4095) + 36 + 400."""
    first = torch.ones(4096)
    first[7] = 10.0
    second = torch.zeros(4096)
    second[[1, 99, 2000, 4095]] = 3.0
    x = torch.cat([first, second, torch.full((100,), -2.0)])
    want = (100 + 40 + 36 + 4) / (100 + 4095 + 36 + 400)
    assert te.top_share([x], 0.01) == pytest.approx(want)
    # tensors are chunked one by one: the same values as two tensors give the same share here
    assert te.top_share([x[:4096], x[4096:]], 0.01) == pytest.approx(want)
    assert te.top_share([x], 1.0) == pytest.approx(1.0)


@pytest.mark.timeout(30)
def test_per_round_means_each_rounds_workers(te):
    records = [{"a": v} for v in (1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 14.0)]
    assert te.per_round(records, "a") == [2.5, 11.0]
