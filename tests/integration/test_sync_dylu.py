"""Sync DiLoCo with DyLU in the simulator (`--method diloco --dylu`, core/dylu.py): with equal
speeds it is plain sync DiLoCo bit for bit; with unequal ones its rounds follow the hand-worked
clock, spend plain sync's budget, and resume bit for bit."""

import dataclasses

import pytest
from conftest import check_summary
from safetensors.torch import load_file

from diloco.cli.main import main
from diloco.config import DyluConfig, SimConfig
from diloco.run.train import train
from diloco.rundir.metrics import read_metrics

pytestmark = pytest.mark.timeout(120)


def _params(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _equal(a, b):
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.mark.parametrize("by", ["steps", "time"])
def test_with_equal_speeds_sync_dylu_is_plain_sync_diloco_bit_for_bit(tiny, tmp_path, by):
    sim = SimConfig(speeds=(1.5, 1.5), speed_jitter=0.0, procs=1)
    plain = train(tiny(sim=sim, out=str(tmp_path / "plain")), progress=False)
    dylu = train(
        tiny(sim=sim, dylu=DyluConfig(enabled=True, by=by), out=str(tmp_path / "dylu")), progress=False
    )
    assert _equal(_params(tmp_path / "plain"), _params(tmp_path / "dylu"))
    assert (dylu["sim_time_s"], dylu["outer_updates"], dylu["val_loss"]) == (
        plain["sim_time_s"],
        plain["outer_updates"],
        plain["val_loss"],
    )


@pytest.mark.parametrize("by", ["steps", "time"])
def test_rounds_follow_the_hand_worked_clock_and_spend_the_budget(tiny, tmp_path, by):
    # Speeds 1.0 and 2.5 s/step, H = 10, a budget of 2 × 3 × 10 = 60 steps. Round 1 measures:
    # both take 10 steps and it ends at 25 s. Then H_w = 10 and ⌊10 / 2.5⌋ = 4 (a deadline of
    # 10 s fits the same): rounds of 10 s, at 35 and 45 s, 48 steps spent. 12 are left, under
    # 14: the last round takes ⌊10 · 12/14⌋ = 8 and ⌊4 · 12/14⌋ = 3, max(8, 7.5) s, ending at
    # 53 s with 59 spent; 1 is left, less than a step each, so the run ends there.
    cfg = tiny(
        inner_steps=10,
        eval_every=0,
        sim=SimConfig(speeds=(1.0, 2.5), procs=1),
        dylu=DyluConfig(enabled=True, by=by),
    )
    summary = train(cfg, progress=False)
    outer = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "outer"]
    assert [m["sim_time_s"] for m in outer] == [25.0, 35.0, 45.0, 53.0]
    assert [m["inner_step"] for m in outer] == [10, 17, 24, 29]
    assert summary["inner_steps_per_worker"] == [10 + 10 + 10 + 8, 10 + 4 + 4 + 3]
    assert summary["outer_updates"] == 4
    check_summary(summary, tmp_path / "run", cfg.data.batch_size * cfg.model.seq_len, 29)


def test_a_stopped_run_resumes_to_the_straight_runs_parameters(tiny, tmp_path, capsys):
    sim = SimConfig(speeds=(1.0, 2.5), speed_jitter=0.2, procs=1)
    cfg = tiny(inner_steps=10, rounds=4, eval_every=0, sim=sim, dylu=DyluConfig(enabled=True))
    train(dataclasses.replace(cfg, out=str(tmp_path / "straight")), progress=False)
    train(dataclasses.replace(cfg, out=str(tmp_path / "stopped")), stop_after=2, progress=False)
    assert main(["train", "--resume", str(tmp_path / "stopped"), "--no-progress"]) == 0
    assert _equal(_params(tmp_path / "stopped"), _params(tmp_path / "straight"))
    times = [
        [m["sim_time_s"] for m in read_metrics(tmp_path / d) if m["kind"] == "outer"]
        for d in ("straight", "stopped")
    ]
    assert times[0] == times[1] and len(times[0]) > 4  # more rounds than plain sync's 4


def test_deadlines_keep_rounds_short_under_jitter(tiny, tmp_path):
    # Each round's time per step is ±30%: H_w from last round's measurements can land a worker
    # well past the fastest; a deadline stops every worker at H × the fastest estimate.
    sim = SimConfig(speeds=(1.0, 2.5), speed_jitter=0.3, procs=1)
    ends = {}
    for by in ("steps", "time"):
        cfg = tiny(inner_steps=20, rounds=6, eval_every=0, sim=sim, dylu=DyluConfig(enabled=True, by=by))
        train(dataclasses.replace(cfg, out=str(tmp_path / by)), progress=False)
        outer = [m["sim_time_s"] for m in read_metrics(tmp_path / by) if m["kind"] == "outer"]
        ends[by] = outer
    # after the first (measuring) round, a deadline round never runs past 20 × the fastest
    # estimate (≤ 20 × 1.3 s)
    assert max(b - a for a, b in zip(ends["time"], ends["time"][1:], strict=False)) <= 20 * 1.3
    assert ends["time"][-1] < ends["steps"][-1]


# -- under torchrun: ranks all-gather their measured step times and plan the same rounds -------


def _torchrun_dylu(tmp_path, name, *flags):
    from test_collective import _torchrun

    proc = _torchrun(tmp_path, 2, "--dylu", "--out", str(tmp_path / name), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _params(tmp_path / name), [m for m in read_metrics(tmp_path / name) if m["kind"] == "inner"]


@pytest.mark.slow  # the suite's 10 minutes: the slower-device test below checks this runtime too
@pytest.mark.timeout(120)
def test_under_torchrun_equal_emulated_speeds_give_plain_sync_diloco_bit_for_bit(tiny, tmp_path):
    # Both ranks' steps padded to 50 ms (--speeds under torchrun): equal measured speeds, every
    # worker takes H every round, and the run is the plain simulator run's bit for bit.
    real, inner = _torchrun_dylu(tmp_path, "c", "--speeds", "0.05,0.05")
    assert [m["steps"] for m in inner] == [4] * 6
    train(tiny(out=str(tmp_path / "s")), progress=False)  # plain sync, the same TINY settings
    assert _equal(real, _params(tmp_path / "s"))


@pytest.mark.timeout(120)
def test_under_torchrun_a_slower_emulated_device_takes_fewer_steps_as_in_the_simulator(tiny, tmp_path):
    # Steps of 20 and 50 ms: after the measuring round worker 1 takes ⌊0.4 · 6⌋ = 2 steps to
    # worker 0's 6 (timing noise would have to reach 10% to change it), rounds go on until
    # 2 × 3 × 6 = 36 steps are spent, and θ is the simulator's with the same profile bit for bit.
    real, inner = _torchrun_dylu(tmp_path, "c", "--speeds", "0.02,0.05", "--inner-steps", "6")
    assert [m["steps"] for m in inner] == [6, 6] + [6, 2] * 3
    sim = SimConfig(speeds=(0.02, 0.05), procs=1)
    cfg = tiny(inner_steps=6, eval_every=0, sim=sim, dylu=DyluConfig(enabled=True), out=str(tmp_path / "s"))
    train(cfg, progress=False)
    assert _equal(real, _params(tmp_path / "s"))


# -- on the parameter server: the members' measured speeds plan each round at its begin ------


def _server_dylu(tmp_path, inner_steps, step_s):
    """The run's θ, each inner line's steps, and the emulated seconds per step by slot (the
    workers take slots in the order they join)."""
    from test_server import address, finish, serve, slot_of, worker

    run = ["--workers", "2", "--inner-steps", str(inner_steps), "--rounds", "3", "--dylu"]
    srv = serve(tmp_path, *run)
    at = address(tmp_path / "run")
    workers = [worker(at, "--step-s", str(s)) for s in step_s]
    results = finish(srv, *workers)
    assert [rc for rc, _ in results] == [0, 0, 0], results
    by_slot = {slot_of(tmp_path / "run", p): s for p, s in zip(workers, step_s, strict=True)}
    from diloco.run.replay import replay

    assert replay(tmp_path / "run")["bitwise_equal"]
    inner = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "inner"]
    return _params(tmp_path / "run"), [m["steps"] for m in inner], (by_slot[0], by_slot[1])


@pytest.mark.slow  # the suite's 10 minutes: the slower-device test below checks this runtime too
@pytest.mark.timeout(180)
def test_on_the_server_equal_emulated_speeds_give_plain_sync_diloco_bit_for_bit(tiny, tmp_path):
    real, steps, _ = _server_dylu(tmp_path, 4, (0.05, 0.05))
    assert steps == [4] * 6
    train(tiny(out=str(tmp_path / "s"), eval_every=0), progress=False)
    assert _equal(real, _params(tmp_path / "s"))


@pytest.mark.slow  # the suite's 10 minutes: the planner is the simulator's, tested there
@pytest.mark.timeout(180)
def test_on_the_server_a_slower_emulated_device_takes_fewer_steps_as_in_the_simulator(tiny, tmp_path):
    # as under torchrun: 20 and 50 ms a step, H = 6: rounds of 6 + 6, then 6 + 2 until 36 steps
    real, steps, speeds = _server_dylu(tmp_path, 6, (0.02, 0.05))
    assert steps == [6, 6] + ([6, 2] if speeds[0] < speeds[1] else [2, 6]) * 3
    sim = SimConfig(speeds=speeds, procs=1)
    cfg = tiny(inner_steps=6, eval_every=0, sim=sim, dylu=DyluConfig(enabled=True), out=str(tmp_path / "s"))
    train(cfg, progress=False)
    assert _equal(real, _params(tmp_path / "s"))
