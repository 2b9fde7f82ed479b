import math

import pytest

from diloco.config.parsers import Slowdown, parse_slowdown
from diloco.core.async_policy import (
    SCATTER_WINDOW,
    ArrivalScatter,
    SpeedEstimator,
    aligned_job_s,
    budget_job,
    dylu_steps,
    expected_steps,
    grace_close,
    grace_period,
    job_seconds,
    shard_probabilities,
    steps_within,
)
from diloco.runtime.clock import Clock, profile


def test_heterogeneity_levels_span_their_spread():
    assert profile("none", 4) == [1.0] * 4
    very = profile("very", 4)
    assert very[0] == 1.0 and very[-1] / very[0] >= 5.0
    assert very == sorted(very)


def test_network_costs_bytes_over_bandwidth_plus_latency():
    clock = Clock([1.0], bandwidth_mbps=80, latency_ms=20)
    assert clock.transfer_s(10_000_000) == pytest.approx(1.0 + 0.02)  # 80 Mbit / 80 Mbit/s
    assert Clock([1.0]).transfer_s(10**9) == 0.0


def test_slowdown_applies_step_by_step_inside_its_window():
    clock = Clock([1.0, 2.0], slowdowns=(Slowdown(1, 4.0, 10.0, 20.0),))
    assert clock.compute_s(0, 0.0, 5, job=0) == 5.0
    # worker 1 from t=6: steps start at 6, 8 (normal, 2 s), then 10 (slowed: 8 s) -> 18, then 18 -> 26
    assert clock.compute_s(1, 6.0, 4, job=0) == pytest.approx(2 + 2 + 8 + 8)
    assert clock.true_step_s(1, 15.0) == 8.0 and clock.true_step_s(1, 25.0) == 2.0
    assert parse_slowdown("2:4@100-200") == Slowdown(2, 4.0, 100.0, 200.0)


def test_jitter_is_deterministic_per_worker_and_job_and_bounded():
    a = Clock([1.0, 1.0], jitter=0.2, seed=3)
    b = Clock([1.0, 1.0], jitter=0.2, seed=3)
    times = [a.compute_s(w, 0.0, 10, job=j) for w in (0, 1) for j in range(5)]
    assert times == [b.compute_s(w, 0.0, 10, job=j) for w in (0, 1) for j in range(5)]
    assert len(set(times)) == len(times) and all(8.0 <= t <= 12.0 for t in times)


def test_dylu_floor_formula():
    # H_w = max(1, floor(v_w / max v * H)), v = 1 / seconds per step
    assert dylu_steps([0.58, 0.75, 1.51, 3.33], 50) == [
        50,
        math.floor(0.58 / 0.75 * 50),
        math.floor(0.58 / 1.51 * 50),
        math.floor(0.58 / 3.33 * 50),
    ]
    assert dylu_steps([1.0, 1000.0], 10) == [10, 1]


def test_speed_estimate_converges_and_follows_a_step_change():
    est = SpeedEstimator(alpha=0.5)
    assert est.step_s is None
    for _ in range(3):
        est.update(20.0, 10)  # a constant 2 s per step
    assert est.step_s == 2.0
    for _ in range(8):
        est.update(80.0, 10)  # the worker becomes 4x slower
    assert est.step_s == pytest.approx(8.0, rel=0.01)


def test_shard_probabilities_favour_shards_behind_their_share():
    assert shard_probabilities([100, 300], [0, 0]) == [0.25, 0.75]
    p = shard_probabilities([100, 300], [50, 50])  # shard 0 is ahead of its 25% share
    assert p == [0.0, 1.0]
    assert shard_probabilities([100, 300], [25, 75]) == [0.25, 0.75]


@pytest.mark.parametrize(
    "in_flight,close",
    [
        # nobody else in flight: the group is the first push alone, restarted at once
        ([], 10.0),
        # one push due and landing inside the window: close when it lands, not at the window's end
        ([(11.0, 11.0)], 11.0),
        # another expected outside the window does not hold the group back
        ([(11.0, 11.0), (20.0, 20.0)], 11.0),
        # one expected inside the window but late: the server waits to the window's end
        ([(11.0, 11.0), (14.0, 12.0)], 13.0),
        # one the server cannot predict yet may land any time: wait for it, to the window's end
        ([(12.5, None)], 12.5),
        ([(20.0, None)], 13.0),
        # one not expected that lands early anyway is caught while waiting for another
        ([(10.5, 30.0), (12.0, 12.0)], 12.0),
    ],
)
def test_grace_window_closes_at_the_last_expected_push(in_flight, close):
    assert grace_close(10.0, 3.0, in_flight) == close


def test_unbounded_grace_waits_for_every_push_in_flight():
    assert grace_close(10.0, math.inf, [(11.0, 50.0), (90.0, 12.0)]) == 90.0


@pytest.mark.parametrize(
    "seconds,durations,steps",
    [
        # 1 s steps in 3.5 s: after 3 steps, a 4th (at the mean, 1 s) would end at 4 > 3.5
        (3.5, [1.0] * 10, 3),
        # a step longer than the whole job: still one step
        (0.5, [2.0] * 10, 1),
        # the worker judges by its mean so far: after 1 + 1 s a third step "fits" in 3.4 s, and
        # takes 2 s; then it stops (4 s spent)
        (3.4, [1.0, 1.0, 2.0, 1.0], 3),
        # H equal steps fit a job of H × s exactly, whatever the rounding of the sum
        (50 * 0.58, [0.58] * 60, 50),
    ],
)
def test_a_deadline_job_takes_the_steps_that_fit(seconds, durations, steps):
    assert steps_within(seconds, iter(durations)) == steps


@pytest.mark.parametrize(
    "steps,seconds,room,others,job",
    [
        # far from the budget's end: the full headroom, DEADLINE_CAP × steps
        (10, 2.0, 100, 30, (10, 2.0, 20)),
        # the headroom is what the others' next jobs (4) leave: 16 − 10 − 4 = 2
        (10, 2.0, 16, 4, (10, 2.0, 12)),
        # nothing left beyond them: a deadline with no headroom (cap = steps), not a wait
        (10, 2.0, 12, 4, (10, 2.0, 10)),
        # the room cannot hold the steps: a job of exact steps, the room
        (10, 2.0, 6, 4, (6, None, None)),
        # exact jobs (fixed H, DyLU by steps) take at most the room, never a headroom
        (10, None, 100, 0, (10, None, None)),
        (10, None, 3, 0, (3, None, None)),
        # nothing left: steps ≤ 0 (the caller hands out nothing)
        (10, 2.0, 0, 4, (0, None, None)),
    ],
)
def test_the_budget_gives_a_deadline_job_headroom_only_from_spare_room(steps, seconds, room, others, job):
    assert budget_job(steps, seconds, room, others) == job


def test_a_next_jobs_expected_steps_are_what_fits_or_the_probe():
    assert expected_steps(29.0, 0.58, 50) == 50  # 50 × 0.58 fits 50 exactly, rounding aside
    assert expected_steps(29.0, 1.51, 50) == 19
    assert expected_steps(1.0, 3.33, 50) == 1  # at least one step
    assert expected_steps(29.0, None, 50) == 50  # not measured yet (its probe may be running): H


def test_a_deadline_is_h_steps_of_the_fastest_and_the_clock_gives_each_steps_time():
    assert job_seconds(50, [0.75, 0.58, 3.33]) == 50 * 0.58
    clock = Clock([1.0, 2.0], slowdowns=(Slowdown(1, 3.0, 4.0, math.inf),))
    times = clock.step_times(1, 0.0, job=0)
    assert [next(times) for _ in range(4)] == [2.0, 2.0, 6.0, 6.0]  # 3x from the step starting at 4 s
    assert steps_within(9.0, clock.step_times(1, 0.0, job=0)) == 3  # 2 + 2 (+2 at the mean fits) + 6


@pytest.mark.parametrize(
    "in_flight,close",
    [
        # the first push landed at 8, before its deadline at 10: the window runs from 10 to 13
        ([(9.5, 10.0)], 9.5),  # the other one due at 10 lands at 9.5: closed then
        ([(12.0, 10.0)], 12.0),  # ... lands late but inside the window
        ([(14.0, 10.0)], 13.0),  # ... lands after it: closed at the window's end
        ([], 8.0),  # nobody else: closed when the push landed
    ],
)
def test_a_window_opened_by_an_early_deadline_push_runs_from_its_deadline(in_flight, close):
    assert grace_close(8.0, 3.0, in_flight, opens_s=10.0) == close


@pytest.mark.parametrize(
    "now,deadlines,end",
    [
        (10.0, [], 16.0),  # nothing in flight: a whole job
        (10.0, [15.0], 15.0),  # 5 s left of the job in flight, at least half a job: end with it
        (10.0, [13.0], 13.0),  # exactly half a job left: still with it
        (10.0, [12.0], 18.0),  # 2 s left: one job after it (8 s)
        (10.0, [12.0, 14.0], 14.0),  # the latest deadline in flight
        (100.0, [12.0], 108.0),  # long past (a lost worker's job): on its grid, 8 s from now
    ],
)
def test_a_deadline_job_ends_with_those_in_flight(now, deadlines, end):
    assert now + aligned_job_s(now, 6.0, deadlines) == end


def test_a_measured_grace_spans_the_spread_of_recent_arrivals():
    scatter = ArrivalScatter()
    for landed in (99.0, 101.0, 100.5):  # 10 s jobs expected at 100: -0.1, +0.1, +0.05 of a job
        scatter.add(landed, 100.0, 10.0)
    assert scatter.spread() is None  # fewer than 4 known: a tenth of a job
    assert grace_period("measured", 50, [0.5, 1.0], scatter.spread()) == pytest.approx(2.5)
    scatter.add(100.0, 100.0, 10.0)
    # deciles (inclusive) of [-0.1, 0, 0.05, 0.1]: the 10th at -0.07, the 90th at 0.085
    assert scatter.spread() == pytest.approx(0.155)
    assert grace_period("measured", 50, [0.5, 1.0], scatter.spread()) == pytest.approx(0.155 * 25)
    assert grace_period("auto", 50, [0.5, 1.0], scatter.spread()) == pytest.approx(2.5)  # auto ignores it
    for _ in range(SCATTER_WINDOW):  # only the last SCATTER_WINDOW count: all on time now
        scatter.add(100.0, 100.0, 10.0)
    assert scatter.spread() == 0.0


def test_a_worker_given_a_deadline_takes_what_fits_and_says_so():
    import torch

    from diloco.core.inner import Worker

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worker = Worker(model, opt, iter([None] * 20), loss_fn=lambda m, _: m.weight.sum())
    start = [p.detach().clone() for p in model.parameters()]
    assert worker.run(start, 5, seconds=0.0).steps == 1  # the first step always, then nothing fits
    assert worker.run(start, 5, seconds=1e9).steps == 5  # `steps` bounds a long deadline
    assert worker.run(start, 3).steps == 3 and worker.step == 9  # without one: all of them
