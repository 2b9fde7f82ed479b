"""benchmarks/reproduce_diloco.py's `dp_steps_to_match`: DiLoCo's run counted in data parallel's
steps (the share of them after which data parallel's mean evaluation curve reaches DiLoCo's final
evaluation), checked against hand-computed interpolations."""

from pathlib import Path

import pytest
from conftest import benchmark_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _rd():
    return benchmark_module("reproduce_diloco")


class _Curves:
    """What dp_steps_to_match asks of a context: each run's evaluation curve."""

    def __init__(self, curves: dict[str, list[tuple[int, float]]]):
        self.curves = curves

    def curve(self, name):
        points = self.curves.get(name, [])
        return [x for x, _ in points], [y for _, y in points]


@pytest.mark.timeout(30)
def test_steps_to_reach_interpolates_between_the_evaluations_either_side():
    rd = _rd()
    xs, ys = [0, 50, 100, 150], [2.2, 2.4, 2.0, 1.8]  # a warm start's rise, then the fall
    assert rd.steps_to_reach(xs, ys, 1.9) == pytest.approx(125.0)  # halfway from 2.0 to 1.8
    assert rd.steps_to_reach(xs, ys, 2.1) == pytest.approx(87.5)  # 2.4 → 2.0: a quarter left
    assert rd.steps_to_reach(xs, ys, 2.0) == 100.0  # exactly an evaluation
    assert rd.steps_to_reach(xs, ys, 1.7) is None  # never gets there
    assert rd.steps_to_reach(xs, ys, 2.3) == 0.0  # already there at the start


@pytest.mark.timeout(30)
def test_dp_steps_to_match_averages_the_seeds_and_reads_diloco_final_evaluation():
    rd = _rd()
    ctx = _Curves(
        {
            "dp0": [(0, 3.0), (100, 2.0), (200, 1.0)],
            "dp1": [(0, 3.0), (100, 2.4), (200, 1.4)],  # mean: 3.0, 2.2, 1.2
            "di0": [(0, 3.0), (100, 2.5), (200, 1.6)],
            "di1": [(0, 3.0), (100, 2.5), (200, 2.0)],  # final mean 1.8
        }
    )
    dp, di = {"runs": ["dp0", "dp1"]}, {"runs": ["di0", "di1"]}
    # 1.8 lies 0.4 of the way from 2.2 (step 100) to 1.2 (step 200): step 140 of 200
    assert rd.dp_steps_to_match(ctx, dp, di, 200) == (0.7, None)
    share, why = rd.dp_steps_to_match(ctx, dp, {"runs": ["dp0"]}, 200)  # 1.0: below dp's mean
    assert share is None and why.startswith("never")
    no_curve = (None, "no whole evaluation curve for every run")
    assert rd.dp_steps_to_match(ctx, dp, {"runs": ["di0", "gone"]}, 200) == no_curve
    assert rd.dp_steps_to_match(ctx, dp, di, 300) == no_curve  # curves that stop short of the run
    for bad in ({**dp, "missing": ["dp2"]}, {**dp, "failed": ["dp1"]}):
        assert rd.dp_steps_to_match(ctx, bad, di, 200) == (None, "a run is missing or failed")


@pytest.mark.timeout(30)
def test_dp_steps_to_match_has_no_share_from_a_curve_that_is_not_numbers():
    """A diverged run's evaluations (null, NaN) give no share rather than a crash."""
    rd = _rd()
    for bad in (None, float("nan")):
        ctx = _Curves({"dp0": [(0, 3.0), (100, 2.0)], "di0": [(0, 3.0), (100, bad)]})
        assert rd.dp_steps_to_match(ctx, {"runs": ["dp0"]}, {"runs": ["di0"]}, 100)[0] is None


@pytest.mark.timeout(30)
def test_dp_steps_to_match_uses_only_the_steps_every_seed_evaluated():
    rd = _rd()
    ctx = _Curves(
        {
            "dp0": [(0, 3.0), (50, 2.5), (100, 2.0)],
            "dp1": [(0, 3.0), (100, 2.0)],  # no evaluation at 50: the mean is 3.0, 2.0
            "di0": [(0, 3.0), (100, 2.5)],
        }
    )
    assert rd.dp_steps_to_match(ctx, {"runs": ["dp0", "dp1"]}, {"runs": ["di0"]}, 100) == (0.5, None)


@pytest.mark.timeout(30)
def test_part_dp_reports_each_H_gap_steps_to_match_and_bytes_ratio():
    """Each k, start and H of `--dp-hs` has its own gap, steps to match and bytes ratio, from
    its DiLoCo entry (k = 8 at H = 10 is a headline of issue 36 that is not the head H); read
    from the `--quick` fixture that the real code wrote."""
    import json

    data = json.loads((BENCH.parent / "tests" / "fixtures" / "reproduce_quick_issue36.json").read_text())
    dp = data["dp"]
    checked = 0
    for row in dp["per_k"].values():
        for start in dp["starts"]:
            base = row[start]["dp"]["bytes_sent_per_worker"]
            for H, e in row[start]["diloco_by_H"].items():
                assert row[f"diloco_{start}_H{H}_vs_dp_gap"] == e["vs_dp"]
                assert row[f"diloco_{start}_H{H}_dp_steps_to_match"] == e["dp_steps_to_match"]
                assert row[f"bytes_ratio_vs_dp_{start}_H{H}"] == round(base / e["bytes_sent_per_worker"], 3)
                checked += 1
    assert checked == len(dp["per_k"]) * len(dp["starts"]) * len(dp["hs"])


@pytest.mark.timeout(30)
def test_peak_is_the_highest_evaluation_after_the_start_and_says_how_far_above_it():
    """Part H500's explanation of a miss by rounds: a curve that first rises (the average of
    workers far apart) peaks above its start; one that only falls peaks below it."""
    rd = _rd()
    rises = rd.peak([0, 500, 1000, 1500], [2.0, 2.5, 3.0, 1.5])
    assert rises == {"step": 1000, "val_loss": 3.0, "vs_start": 0.5}
    falls = rd.peak([0, 50, 100], [2.0, 1.8, 1.6])
    assert falls == {"step": 50, "val_loss": 1.8, "vs_start": -0.1}  # never above the start
    assert rd.peak([0, 1, 2], [2.0, 3.0, 3.0])["step"] == 1  # the first of equal highs
    assert rd.peak([0], [2.0]) is None  # no evaluation after the start
    for bad in (None, float("nan")):
        assert rd.peak([0, 1], [2.0, bad]) is None


@pytest.mark.timeout(30)
def test_gap_by_step_compares_the_mean_curves_at_each_step_both_evaluated_after_the_start():
    rd = _rd()
    ctx = _Curves(
        {
            "dp0": [(0, 3.0), (100, 2.0), (200, 1.0)],
            "dp1": [(0, 3.0), (100, 2.0), (200, 1.0)],
            "di0": [(0, 3.0), (100, 3.0), (150, 2.0), (200, 1.1)],  # 150: data parallel has none
            "di1": [(0, 3.0), (100, 2.0), (200, 1.1)],  # mean: 2.5 at 100, 1.1 at 200
        }
    )
    dp, di = {"runs": ["dp0", "dp1"]}, {"runs": ["di0", "di1"]}
    assert rd.gap_by_step(ctx, dp, di) == {"100": 0.25, "200": 0.1}
    assert rd.gap_by_step(ctx, dp, {"runs": ["gone"]}) is None
    assert rd.gap_by_step(ctx, {"runs": []}, di) is None
