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
    # a seed whose run failed (diverged) is the worst stall, even beside a single finished seed
    assert rd._stalled({**_e(1.9), "failed_seeds": ["2"]}) == ["2"]
    assert rd._stalled({**_e(1.9, 2.1), "failed_seeds": ["2"]}) == ["1", "2"]


@pytest.mark.timeout(30)
def test_the_ablation_lr_is_the_grid_point_below_rounded_as_a_widened_grid_is():
    rd = _rd()
    assert rd._lr_below(8e-3) == 4e-3 and rd._lr_below(3.2e-2) == 1.6e-2
    x = rd._lr_below(2.5e-4)  # 1.25e-4 has three significant digits; a widened grid's point two
    assert x in (1.2e-4, 1.3e-4) and x == float(f"{x:.2g}")


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


class _Arm:
    """What IfStalled asks of a DiLoCo arm: its grid and reported runs, its picks and its maker."""

    seeds = [0, 1, 2]

    def __init__(self, rd):
        self.rd = rd
        self.grid = [rd.Run("g", "grid", 100, ("--g",))]

    def make(self, lr, ilr, w, s):
        return self.rd.Run(
            f"d-{ilr:g}-s{s}", f"lr {lr} inner {ilr} wu {w} s{s}", s, ("--inner-lr", f"{ilr:g}")
        )

    def grid_runs(self, ctx):
        return self.grid

    def runs(self, ctx):
        return [self.make(0.7, 4e-3, 30, s) for s in self.seeds] if "g" in ctx.losses else []

    def picked(self, ctx):
        return (4e-3, 30)

    def best(self, ctx):
        return 0.7


class _Ctx:
    jobs = 2

    def __init__(self, losses: dict[str, float]):
        self.losses = dict(losses)
        self.trained: list[str] = []

    def finished(self, run, model=False):
        return run.name in self.losses

    def result(self, run):
        v = self.losses.get(run.name)
        return None if v is None else {"val_loss": v, "bytes_sent_per_worker": 0, "inner_steps": 1000}

    def train(self, run):
        self.trained.append(run.name)
        self.losses[run.name] = {"d-0.004-s1": 2.2}.get(run.name, 1.9)  # seed 1 stalls (+16%)
        return True, 0.0


@pytest.mark.timeout(30)
def test_diloco_gets_the_ablation_below_its_pick_only_once_its_seeds_ran_and_one_stalled():
    rd = _rd()
    arm = _Arm(rd)
    t = rd.IfStalled(arm)
    assert t.runs(_Ctx({})) == [] and [r.name for r in t.grid_runs(_Ctx({}))] == ["g"]
    seeds = {f"d-0.004-s{s}": v for s, v in enumerate((1.90, 1.92, 1.91))}
    assert t.runs(_Ctx({"g": 1.8, "d-0.004-s0": 1.9})) == []  # seeds 1 and 2 have not run
    assert t.settings(_Ctx({"g": 1.8, **seeds})) is None  # every seed within 5%: no ablation
    stalled = {**seeds, "d-0.004-s1": 2.05}  # +7.9% above seed 0
    assert t.settings(_Ctx({"g": 1.8, **stalled})) == (0.7, 2e-3, 30)
    got = t.runs(_Ctx({"g": 1.8, **stalled}))
    assert [(r.name, r.seed) for r in got] == [(f"d-0.002-s{s}", s) for s in (0, 1, 2)]


@pytest.mark.timeout(30)
def test_the_scheduler_runs_the_stall_ablation_after_the_seeds_it_judges():
    """The arm's grid, then its seeds (the IfStalled's grid too), then, seed 1 having stalled,
    the ablation at half the inner lr; `--pending` counts none of it in advance."""
    rd = _rd()
    ctx = _Ctx({})
    plan = rd.Plan(tuned=[rd.IfStalled(_Arm(rd))])
    rd.Scheduler(ctx, lambda part, span, done: None).execute({"dp": plan})
    assert ctx.trained[0] == "g" and sorted(ctx.trained[1:4]) == [f"d-0.004-s{s}" for s in (0, 1, 2)]
    assert sorted(ctx.trained[4:]) == [f"d-0.002-s{s}" for s in (0, 1, 2)]
    assert rd._future(rd.IfStalled(_Arm(rd)), _Ctx({})) == []
