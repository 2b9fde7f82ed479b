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


@pytest.mark.timeout(60)
def test_h500_tuning_figure_waits_for_every_pick_then_plots_their_curves(tmp_path, monkeypatch):
    """Part H500's tuning figure: nothing until every arm has a pick with a curve; then each H's
    pick against outer rounds (its steps ÷ H) and inner steps, and data parallel's pick against
    steps, with its final evaluation as the rounds panel's reference line."""
    import matplotlib.figure

    rd = _rd()
    ctx = _Curves(
        {
            "dp": [(0, 2.2), (500, 1.8), (1000, 1.5)],
            "h50": [(0, 2.2), (500, 1.9), (1000, 1.6)],
            "h500": [(0, 2.2), (500, 4.0), (1000, 1.7)],
        }
    )
    r = {"k": 4, "steps_per_worker": 1000, "dp": {"tuning_run": "dp"}}
    r["by_H"] = {"50": {"tuning_run": "h50"}, "500": {"tuning_run": None}}  # H = 500 has not picked
    assert rd._h500_tuning_figure(ctx, r, tmp_path) is None
    r["by_H"]["500"]["tuning_run"] = "gone"  # a pick without a curve
    assert rd._h500_tuning_figure(ctx, r, tmp_path) is None
    ctx.curves["nan"] = [(0, 2.2), (500, float("nan")), (1000, 1.7)]  # a pick that diverged
    r["by_H"]["500"]["tuning_run"] = "nan"
    assert rd._h500_tuning_figure(ctx, r, tmp_path) is None
    assert not list(tmp_path.iterdir())

    saved = []
    keep = lambda fig, path, **kw: saved.append((fig, path))  # noqa: E731  (the drawn figure, unsaved)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    r["by_H"]["500"]["tuning_run"] = "h500"
    path = rd._h500_tuning_figure(ctx, r, tmp_path, "_x")
    assert path == str(tmp_path / "reproduce_H500_tuning_x.png")
    ((fig, where),) = saved
    assert str(where) == path
    by_round, by_step = fig.axes
    lines = {ln.get_label(): ln for ln in by_round.lines}
    assert list(lines["DiLoCo H=50"].get_xdata()) == [0, 10, 20]
    assert list(lines["DiLoCo H=500"].get_xdata()) == [0, 1, 2]
    assert list(lines["data parallel (its final evaluation)"].get_ydata()) == [1.5, 1.5]
    steps = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in by_step.lines}
    assert steps["data parallel (k× batch)"] == ([0, 500, 1000], [2.2, 1.8, 1.5])
    assert steps["DiLoCo H=500"] == ([0, 500, 1000], [2.2, 4.0, 1.7])


@pytest.mark.timeout(60)
def test_h500_figure_plots_each_arms_mean_over_the_seeds_with_their_range(tmp_path, monkeypatch):
    """Part H500's figure of the reported seeds: each arm's mean curve (the one `per_round`, `peak`
    and `vs_dp_by_step` read) with a band from the lowest to the highest seed at each evaluation,
    computed here by hand (3 seeds, so a band of mean ± spread would not pass); data parallel's
    mean final evaluation is the rounds panel's reference line; an arm without a pick or a seed
    whose curve is not numbers leaves the figure undrawn."""
    import matplotlib.figure

    rd = _rd()
    ctx = _Curves(
        {
            "dp0": [(0, 2.2), (500, 1.8), (1000, 1.4)],
            "dp1": [(0, 2.2), (500, 2.0), (1000, 1.6)],
            "dp2": [(0, 2.2), (500, 1.9), (1000, 1.5)],
            "a0": [(0, 2.2), (500, 1.9), (1000, 1.6)],
            "a1": [(0, 2.2), (500, 2.1), (1000, 1.8)],
            "a2": [(0, 2.2), (500, 2.3), (1000, 1.7)],
            "b0": [(0, 2.2), (500, 4.0), (1000, 1.7)],
            "b1": [(0, 2.2), (500, 3.0), (1000, 1.9)],
            "b2": [(0, 2.2), (500, 3.2), (1000, 2.2)],
        }
    )
    ctx.seeds = [0, 1, 2]
    r = {"k": 4, "steps_per_worker": 1000, "wall_time": {"runs_missing": 0}}
    r["dp"] = {"runs": ["dp0", "dp1", "dp2"]}
    r["by_H"] = {"50": {"runs": ["a0", "a1", "a2"]}, "500": {"runs": ["b0", "b1", "b2"]}}
    saved = []
    keep = lambda fig, path, **kw: saved.append((fig, path))  # noqa: E731  (the drawn figure, unsaved)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    assert rd.figures(ctx, {"H500": r}, tmp_path) == [str(tmp_path / "reproduce_H500.png")]
    ((fig, _),) = saved
    by_round, by_step = fig.axes
    approx = lambda xs: pytest.approx(xs, abs=1e-9)  # noqa: E731
    steps = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in by_step.lines}
    assert steps["data parallel (k× batch)"] == ([0, 500, 1000], approx([2.2, 1.9, 1.5]))
    assert steps["DiLoCo H=50"] == ([0, 500, 1000], approx([2.2, 2.1, 1.7]))
    assert steps["DiLoCo H=500"] == ([0, 500, 1000], approx([2.2, 3.4, 5.8 / 3]))
    rounds = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in by_round.lines}
    assert rounds["DiLoCo H=50"] == ([0, 10, 20], approx([2.2, 2.1, 1.7]))
    assert rounds["DiLoCo H=500"] == ([0, 1, 2], approx([2.2, 3.4, 5.8 / 3]))
    assert rounds["data parallel (its final evaluation)"][1] == approx([1.5, 1.5])

    def edges(band):
        """A band's (x, y) corners: each evaluation's lowest and highest seed."""
        return {(round(x, 9), round(y, 9)) for x, y in band.get_paths()[0].vertices}

    # the bands, in the order drawn (H = 50, H = 500, data parallel): lowest to highest seed
    h50, h500, dp = by_step.collections
    assert edges(h500) == {(0, 2.2), (500, 3.0), (500, 4.0), (1000, 1.7), (1000, 2.2)}
    assert edges(h50) == {(0, 2.2), (500, 1.9), (500, 2.3), (1000, 1.6), (1000, 1.8)}
    assert edges(dp) == {(0, 2.2), (500, 1.8), (500, 2.0), (1000, 1.4), (1000, 1.6)}
    r50, r500 = by_round.collections  # data parallel has a line there, no band
    assert edges(r500) == {(0, 2.2), (1, 3.0), (1, 4.0), (2, 1.7), (2, 2.2)}
    assert edges(r50) == {(0, 2.2), (10, 1.9), (10, 2.3), (20, 1.6), (20, 1.8)}
    assert by_step.get_yscale() == by_round.get_yscale() == "log"

    saved.clear()
    ctx.curves["b1"] = [(0, 2.2), (500, float("nan")), (1000, 1.9)]  # a seed that diverged
    assert rd.figures(ctx, {"H500": r}, tmp_path) == [] and not saved
    ctx.curves["b1"] = [(0, 2.2), (500, 3.0), (1000, 1.9)]
    r["by_H"]["500"] = {"val_loss": None}  # an arm whose grid had no pick: no runs
    assert rd.figures(ctx, {"H500": r}, tmp_path) == [] and not saved


@pytest.mark.timeout(30)
def test_per_round_compares_two_H_at_equal_bytes_by_hand():
    """H = 500's explanation in bytes: after H = 500's rounds, where H = 50 is, and how many of its
    rounds it needs to reach H = 500's end (interpolated between its evaluations)."""
    rd = _rd()
    hi = (500, [0, 500, 1000], [2.0, 4.0, 1.5])  # 2 rounds, ends at 1.5
    lo = (50, [0, 100, 200, 300], [2.0, 1.8, 1.6, 1.4])  # round 2 (step 100): 1.8; 1.5 at step 250
    assert rd.per_round(lo, hi) == {
        "rounds": 2,
        "val_loss_hi": 1.5,
        "val_loss_lo": 1.8,
        "lo_vs_hi": 0.2,
        "lo_rounds_to_reach_hi": 5.0,
        "lo_rounds_ratio": 2.5,
    }
    never = (50, [0, 100, 200], [2.0, 1.8, 1.6])
    assert rd.per_round(never, hi)["lo_rounds_to_reach_hi"] is None
    assert rd.per_round(never, hi)["lo_rounds_ratio"] is None
    assert rd.per_round((50, [0, 50], [2.0, 1.9]), hi) is None  # no evaluation after round 2
    assert rd.per_round((50, [], []), hi) is None
    assert rd.per_round(lo, (500, [], [])) is None
    assert rd.per_round((50, [0, 100], [2.0, None]), hi) is None  # an evaluation that is not a number
    assert rd.per_round(lo, (500, [0, 500, 1000], [2.0, 4.0, float("nan")])) is None


@pytest.mark.timeout(60)
def test_part_H500_headline_gaps_wait_for_every_seed_of_both_arms(tmp_path):
    """Part H500's report from the ledger in git, its reported seeds set by hand in memory (the
    file is not written): with H = 50 half run, its headline gap and `per_round` are null (a mean
    of one seed against a mean of three is not a comparison) while its row's paired gap is of the
    seeds both have; with every seed of both H run, the gaps are the means' (computed here by hand)
    and `per_round` compares the mean curves."""
    rd = _rd()

    def state(seeds: dict[str, tuple[int, ...]]):
        """A context whose ledger holds, of each H's reported runs, those of `seeds` (each a copy
        of that H's tuning pick's row with its val_loss shifted by the seed)."""
        ctx = rd.Ctx(rd.parse_args(["--workdir", str(tmp_path)]))
        by_H = rd.part_H500(ctx)[1]()["by_H"]
        for H, e in by_H.items():
            pick = ctx.ledger.rows[e["tuning_run"]]
            for seed, name in enumerate(e["runs"]):
                ctx.ledger.rows.pop(name, None)
                if seed in seeds.get(H, ()):
                    summary = {**pick["summary"], "val_loss": pick["summary"]["val_loss"] + seed / 100}
                    ctx.ledger.rows[name] = {**pick, "name": name, "summary": summary}
        ctx._results.clear()  # the first report's results, read before the rows were set
        return ctx, rd.part_H500(ctx)[1]()

    ctx, r = state({"50": (0,)})
    dp = r["dp"]
    assert dp["val_loss"]["n"] == 3, "the ledger in git holds data parallel's three reported seeds"
    h50 = r["by_H"]["50"]
    assert h50["val_loss"]["n"] == 1 and h50["vs_dp"] is not None  # of the seeds run so far
    assert h50["vs_dp_paired"]["mean"] == pytest.approx(
        h50["per_seed"]["0"] / dp["per_seed"]["0"] - 1, abs=1e-5
    )
    assert r["h50_vs_dp_gap"] is None and r["h500_vs_dp_gap"] is None and r["per_round"] is None
    assert r["target_within_2pct_at_400x_fewer_bytes"] is None

    ctx, r = state({"50": (0, 1, 2)})
    m50, mdp = r["by_H"]["50"]["val_loss"]["mean"], r["dp"]["val_loss"]["mean"]
    assert r["h50_vs_dp_gap"] == pytest.approx((m50 - mdp) / mdp, abs=2e-6)
    assert r["h500_vs_dp_gap"] is None and r["per_round"] is None  # H = 500 has not run

    ctx, r = state({"50": (0, 1, 2), "500": (0, 1, 2)})
    m500 = r["by_H"]["500"]["val_loss"]["mean"]
    assert r["h500_vs_dp_gap"] == pytest.approx((m500 - mdp) / mdp, abs=2e-6)
    assert r["target_within_2pct_at_400x_fewer_bytes"] is (r["h500_vs_dp_gap"] <= 0.02)  # bytes 500×
    curves = [(int(H), *rd._mean_curve(ctx, e["runs"])) for H, e in r["by_H"].items()]
    assert r["per_round"] == rd.per_round(*curves) == r["per_round_tuning"]  # copies of the picks' curves


@pytest.mark.timeout(60)
def test_dp_figure_bars_group_by_start_with_each_ablation_hatched_beside_its_pick(tmp_path, monkeypatch):
    """Part dp's bars: per start, single once (not once per k), then each k's data parallel,
    DiLoCo and serial; an ablation below a pick (single's, data parallel's, DiLoCo's from the
    stall rule) hatched right after it; a bar's height the entry's mean."""
    import matplotlib.figure

    rd = _rd()
    ctx = _Curves({n: [(0, 2.2), (1000, 1.5)] for n in ("s0", "d0", "l0")})
    ctx.seeds = [0, 1, 2]

    def e(v: float, runs=None) -> dict:
        return {"val_loss": {"mean": v, "min": v - 0.01, "max": v + 0.01}, "runs": runs or []}

    def row(base: float, warm: bool) -> dict:
        out = {"single": e(base, ["s0"]), "dp": e(base - 0.3, ["d0"]), "diloco": e(base - 0.1, ["l0"])}
        out["single_lr_below"] = e(base - 0.05)
        if warm:
            out["serial"] = e(base - 0.35)
        else:
            out["dp_lr_below"] = e(base - 0.32)
            out["diloco"]["lr_below"] = e(base - 0.12)
        return out

    per_k = {str(k): {"scratch": row(2.0 + k / 100, False), "warm": row(1.8 + k / 100, True)} for k in (4, 8)}
    r = {"k": [4, 8], "headline_k": 8, "per_k": per_k, "wall_time": {"runs_missing": 0}}
    saved = []
    keep = lambda fig, path, **kw: saved.append(fig)  # noqa: E731  (the drawn figure, unsaved)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    assert rd.figures(ctx, {"dp": r}, tmp_path) == [str(tmp_path / "reproduce_dp.png")]
    bars = saved[0].axes[0]
    labels = [t.get_text() for t in bars.get_xticklabels()]
    assert labels == [
        "single scratch", "single scratch lr÷2",
        "dp k=4 scratch", "dp k=4 scratch lr÷2", "diloco k=4 scratch", "diloco k=4 scratch lr÷2",
        "dp k=8 scratch", "dp k=8 scratch lr÷2", "diloco k=8 scratch", "diloco k=8 scratch lr÷2",
        "single warm", "single warm lr÷2",
        "dp k=4 warm", "diloco k=4 warm", "serial k=4 warm",
        "dp k=8 warm", "diloco k=8 warm", "serial k=8 warm",
    ]  # fmt: skip
    patches = bars.patches
    assert [bool(p.get_hatch()) for p in patches] == ["lr÷2" in x for x in labels]
    assert patches[5].get_height() == pytest.approx(2.04 - 0.12)  # DiLoCo k = 4's stall ablation
    assert patches[0].get_height() == pytest.approx(2.04)  # single from scratch at k = 4's row
