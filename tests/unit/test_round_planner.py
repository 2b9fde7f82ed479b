"""Sync DiLoCo with DyLU (core/dylu.py): each round's plan, worked by hand, and the weighting of
outer_grads by the steps each worker took."""

import pytest
import torch

from diloco.core.dylu import SYNC_TOLERANCE, RoundPlanner
from diloco.core.outer import SGD
from diloco.core.outer_side import OuterSide

pytestmark = pytest.mark.timeout(30)


def test_the_first_round_measures_then_h_w_follows_the_measured_speeds():
    planner = RoundPlanner(3, 10, budget=3 * 4 * 10)
    first = planner.plan()
    assert (first.steps, first.seconds, first.lr_step, first.lr_strides) == ([10] * 3, None, 0, [1.0] * 3)
    for w, s in enumerate((1.0, 2.5, 4.0)):
        planner.record(w, 10 * s, 10)
    assert planner.spend(30) == 10
    plan = planner.plan()
    # H_w = max(1, ⌊1.0 / s · 10⌋): 10, 4, 2; the round advances the lr by 16 / 3 steps, which
    # every worker crosses: 10 steps of 0.533, 4 of 1.333, 2 of 2.667
    assert plan.steps == [10, 4, 2] and plan.lr_step == 10
    assert plan.lr_strides == pytest.approx([16 / 30, 16 / 12, 16 / 6])


def test_a_worker_within_the_tolerance_of_the_fastest_takes_h():
    planner = RoundPlanner(2, 50, budget=1000)
    planner.record(0, 1.0, 1)
    planner.record(1, 1.0 + SYNC_TOLERANCE * 0.9, 1)  # timing noise: the same machine
    assert planner.plan().steps == [50, 50] and planner.plan().lr_strides == [1.0, 1.0]
    planner.record(1, 1.2, 1)  # its EMA: 1.1225, 11% slower
    assert planner.plan().steps == [50, 44]


def test_deadlines_expect_what_fits_and_the_last_round_is_scaled_to_the_budget():
    planner = RoundPlanner(2, 10, budget=60, by="time")
    planner.record(0, 10.0, 10)
    planner.record(1, 25.0, 10)
    plan = planner.plan()
    assert plan.seconds == 10.0 and plan.steps == [10, 4]
    planner.spend(46)  # 14 left: 10 + 4 fit
    assert planner.plan().steps == [10, 4]
    planner.spend(2)  # 12 left: scaled to ⌊10 · 12/14⌋ = 8 and ⌊4 · 12/14⌋ = 3, as steps
    last = planner.plan()
    assert (last.steps, last.seconds) == ([8, 3], None)
    planner.spend(11)
    assert planner.done  # 1 left: less than a step per worker


def test_the_planner_state_round_trips():
    planner = RoundPlanner(2, 10, budget=100)
    planner.record(1, 5.0, 10)
    planner.spend(20)
    other = RoundPlanner(2, 10, budget=100)
    other.load_state_dict(planner.state_dict())
    assert (other.spent, other.speeds()) == (20, [None, 0.5])


def _side(k=3):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return OuterSide(model, k, update=SGD(lr=1.0, momentum=0.0))


def _message(side, value):
    return side.codec.encode([torch.full((1, 2), float(value))])


@pytest.mark.parametrize("dropped", [None, 0])
def test_outer_grads_are_weighted_by_the_steps_taken(dropped):
    # Workers took 10, 4 and 2 steps and sent outer_grads of 1, 2 and 4 everywhere: the step is
    # −(10·1 + 4·2 + 2·4) / 16 = −1.625; with worker 0's lost, −(4·2 + 2·4) / 6.
    side = _side()
    side.begin_round(steps=[10, 4, 2])
    messages = []
    for w, value in enumerate((1, 2, 4)):
        counts = side.report(w, 8, lost=w == dropped)
        messages.append(_message(side, value) if counts else None)
    side.end_round(side.reduce(messages), 5)
    want = -(8 + 8) / 6 if dropped == 0 else -(10 + 8 + 8) / 16
    assert side.params[0].flatten().tolist() == pytest.approx([want, want])
    assert side.total_steps == (6 if dropped == 0 else 16) and side.inner_step == 5


def test_equal_steps_keep_the_configured_weights_and_a_deadline_reports_what_it_took():
    side = _side(2)
    side.begin_round(steps=[10, 10])
    counted = [side.report(w, 8) for w in range(2)]
    assert counted == [True, True] and side.round_weights() == [0.5, 0.5]
    side = _side(2)
    side.begin_round(steps=[10, 4])  # planned; the deadline job of worker 1 fit 6
    side.report(0, 8)
    side.report(1, 8, steps=6)
    assert side.round_weights() == pytest.approx([10 / 16, 6 / 16])
    with pytest.raises(ValueError, match="needs begin_round"):
        other = _side(2)
        other.begin_round()
        other.report(0, 8, steps=3)
