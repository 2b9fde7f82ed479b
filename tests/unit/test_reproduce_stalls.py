"""Part dp's stall rule (reproduce_diloco.py `_stalled`, `_stalls`): a reported seed more than 5%
above its arm's lowest stalled; a DiLoCo arm with one is named for the ablation below its pick."""

import pytest
from conftest import benchmark_module


def _rd():
    return benchmark_module("reproduce_diloco")


def _e(*losses: float) -> dict:
    return {"per_seed": {str(s): v for s, v in enumerate(losses)}}


@pytest.mark.timeout(30)
def test_a_seed_more_than_five_percent_above_the_lowest_stalls():
    rd = _rd()
    # nano's single from scratch at its pick: seeds 1 and 2 on the plateau
    assert rd._stalled(_e(1.8603, 2.2221, 2.4474)) == ["1", "2"]
    assert rd._stalled(_e(1.0, 1.05, 1.0501)) == ["2"]  # exactly 5% is not a stall
    assert rd._stalled(_e(1.8918, 1.9268, 1.9149)) == []  # DiLoCo k = 4: within 2%
    assert rd._stalled(_e(2.0)) == [] and rd._stalled(None) == [] and rd._stalled({}) == []


@pytest.mark.timeout(30)
def test_the_stalls_name_every_arm_with_one_and_the_diloco_arms_that_need_an_ablation():
    rd = _rd()
    fine = _e(1.50, 1.51, 1.52)
    per_k = {
        "8": {
            "scratch": {
                "single": _e(1.86, 2.22, 2.45),
                "single_lr_below": fine,
                "dp": _e(1.47, 1.49, 1.66),
                "dp_lr_below": fine,
                "diloco_by_H": {"10": fine, "50": _e(1.88, 2.10, 1.90)},
            },
            "warm": {"single": fine, "dp": fine, "serial": fine, "diloco_by_H": {"50": fine}},
        }
    }
    got = rd._stalls(per_k)
    assert got["seeds"] == {
        "single scratch": ["1", "2"],
        "dp k=8 scratch": ["2"],
        "diloco k=8 H=50 scratch": ["1"],
    }
    assert got["diloco_needs_ablation"] == ["diloco k=8 H=50 scratch"]
    assert "5%" in got["rule"]
    per_k["8"]["scratch"]["diloco_by_H"]["50"] = fine
    assert rd._stalls(per_k)["diloco_needs_ablation"] == []
