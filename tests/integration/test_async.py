"""Asynchronous training in the simulator against sync DiLoCo, across process counts, and bad
async settings."""

import dataclasses
import math

import pytest
from conftest import check_summary
from safetensors.torch import load_file

from diloco.config import AsyncConfig, DyluConfig, SimConfig
from diloco.core.async_rules import DelayedNesterov
from diloco.run.train import train
from diloco.rundir.metrics import read_metrics

SPEEDS = (0.58, 0.75, 1.51, 3.33)
# The bare rule: Algorithm 2's DyLU, shard sampling and grace period off (they are on by default).
BARE = {"shard_sampling": False, "grace_s": 0.0}  # with NO_DYLU
NO_DYLU = DyluConfig(enabled=False)


def _params(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _equal(a, b):
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.mark.timeout(90)
def test_unbounded_grace_and_buffer_of_k_reproduce_sync_diloco(tiny, tmp_path):
    sim = SimConfig(speeds=SPEEDS[:2], procs=1)
    sync = train(tiny(sim=sim, out=str(tmp_path / "sync")), progress=False)
    asyn = train(
        tiny(
            method="async",
            sim=sim,
            async_=AsyncConfig(rule="buffer", **{**BARE, "grace_s": math.inf}),
            dylu=NO_DYLU,
            out=str(tmp_path / "async"),
        ),
        progress=False,
    )
    assert _equal(_params(tmp_path / "sync"), _params(tmp_path / "async"))
    assert asyn["sim_time_s"] == sync["sim_time_s"]
    assert asyn["outer_updates"] == sync["outer_updates"] and asyn["val_loss"] == sync["val_loss"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "method,server",
    [
        ("diloco", AsyncConfig()),
        ("async", AsyncConfig()),
    ],
)
def test_two_processes_equal_one_bitwise(tiny, tmp_path, method, server):
    runs = {}
    for procs in (1, 2, 1):
        out = tmp_path / f"p{procs}-{len(runs)}"
        cfg = tiny(method=method, async_=server, sim=SimConfig(speeds=SPEEDS[:2], procs=procs), out=str(out))
        runs[out] = train(cfg, progress=False)
    (a, sa), (b, sb), (c, sc) = runs.items()
    assert _equal(_params(a), _params(b)) and _equal(_params(a), _params(c))
    strip = ("wall_time_s", "eval_time_s", "run_dir")
    assert {k: v for k, v in sa.items() if k not in strip} == {k: v for k, v in sb.items() if k not in strip}


@pytest.mark.timeout(60)
def test_async_logs_staleness_speed_and_dylu_steps(tiny, tmp_path):
    cfg = tiny(
        method="async",
        rounds=4,
        sim=SimConfig(speeds=(1.0, 3.0), procs=1),
        async_=AsyncConfig(shard_sampling=False, grace_s=0.0),
        target_loss=5.4,
    )
    summary = train(cfg, progress=False)
    lines = read_metrics(tmp_path / "run")
    workers = [line for line in lines if line["kind"] == "worker"]
    assert all({"staleness", "steps", "speed_est_s", "sim_time_s"} <= w.keys() for w in workers)
    slow = [w for w in workers if w["worker"] == 1]
    # DyLU: floor(1/3 * 4) = 1, from the first job on (its probe of 1 step measured the speed)
    assert slow[0]["steps"] == 1 and slow[-1]["speed_est_s"] == 3.0
    assert any(w["staleness"] > 0 for w in workers)
    assert sum(w["steps"] for w in workers) == summary["inner_steps"] == 2 * 4 * 4  # equal compute
    assert summary["time_to_target_s"] is not None
    evals = [line for line in lines if line["kind"] == "eval" and line["split"] == "subset"]
    first = next(e for e in evals if e["val_loss"] <= 5.4)
    assert summary["time_to_target_s"] == first["sim_time_s"]


@pytest.mark.timeout(60)
def test_sync_round_ends_when_the_slowest_push_lands(tiny, tmp_path):
    cfg = tiny(sim=SimConfig(speeds=(1.0, 3.0), bandwidth_mbps=8.0, latency_ms=100.0, procs=1))
    summary = train(cfg, progress=False)
    message_s = summary["params"] * 4 * 8 / 8e6 + 0.1
    assert summary["sim_time_s"] == pytest.approx(3 * (2 * message_s + 4 * 3.0))


@pytest.mark.timeout(60)
def test_a_worker_continuing_after_a_dropped_outer_grad_is_not_charged_a_download(tiny):
    """After its outer_grad was lost a worker continues from its own θ and downloads nothing:
    its next round starts computing at once, by the documented model."""
    from diloco.core.membership import outer_grad_dropped

    speeds = (1.0, 2.0)
    cfg = tiny(drop_prob=0.5, sim=SimConfig(speeds=speeds, bandwidth_mbps=8.0, latency_ms=100.0, procs=1))
    summary = train(cfg, progress=False)
    message_s = summary["params"] * 4 * 8 / 8e6 + 0.1
    t, own, drops = 0.0, [False, False], 0
    for r in range(cfg.rounds):
        t = max(
            t + (0.0 if own[w] else message_s) + cfg.inner_steps * s + message_s for w, s in enumerate(speeds)
        )
        own = [outer_grad_dropped(cfg.seed, r, w, cfg.drop_prob) for w in range(2)]
        drops += sum(own) if r < cfg.rounds - 1 else 0
    assert drops > 0  # the seed loses an outer_grad before the last round
    assert summary["sim_time_s"] == pytest.approx(t)


def test_async_only_settings_are_refused_for_sync(tiny):
    from diloco.errors import UserError

    with pytest.raises(UserError, match="add --method async"):
        tiny(async_=AsyncConfig(rule="naive"))
    with pytest.raises(UserError, match="gives 3 speeds for 2 workers"):
        tiny(sim=SimConfig(speeds=(1.0, 2.0, 3.0)))
    with pytest.raises(UserError, match="W:FACTOR@START-END"):
        dataclasses.replace(tiny(), sim=SimConfig(slowdowns=("5:2@0-1",)))


@pytest.mark.timeout(60)
def test_shard_sampling_hands_out_other_shards_deterministically(tiny, tmp_path):
    sim = SimConfig(speeds=(1.0, 1.3, 4.0), speed_jitter=0.1, procs=1)
    runs = []
    for name in ("a", "b"):
        cfg = tiny(
            method="async",
            num_workers=3,
            rounds=4,
            sim=sim,
            async_=AsyncConfig(),
            out=str(tmp_path / name),
        )
        train(cfg, progress=False)
        runs.append([m for m in read_metrics(tmp_path / name) if m["kind"] == "worker"])
    assert any(m["shard"] != m["worker"] for m in runs[0])
    assert [m["shard"] for m in runs[0]] == [m["shard"] for m in runs[1]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grace_s,times", [(0.0, [4.0, 4.8, 8.0, 9.6]), (1.0, [4.0, 4.8, 8.8, 9.6])])
def test_grace_period_restarts_caught_workers_together(tiny, tmp_path, grace_s, times):
    # 4 steps at 1.0 and 1.2 s: pushes land at 4.0 and 4.8. A 1 s grace after the first catches
    # the second, and both restart at 4.8 from the same parameters; without grace worker 0
    # restarts at once.
    cfg = tiny(
        method="async",
        sim=SimConfig(speeds=(1.0, 1.2), procs=1),
        async_=AsyncConfig(rule="dn", **{**BARE, "grace_s": grace_s}),
        dylu=NO_DYLU,
    )
    train(cfg, progress=False)
    lines = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "worker"]
    assert [round(m["sim_time_s"], 6) for m in lines[:4]] == times


@pytest.mark.timeout(60)
def test_buffer_arrivals_left_at_the_end_are_applied(tiny, tmp_path):
    cfg = tiny(
        method="async",
        rounds=2,
        sim=SimConfig(speeds=(1.0, 3.0), procs=1),
        async_=AsyncConfig(rule="buffer", buffer=3, shard_sampling=False, grace_s=0.0),
    )
    summary = train(cfg, progress=False)
    arrivals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "worker"]
    assert len(arrivals) % 3 != 0  # some are left in the buffer at the end
    assert summary["outer_updates"] == -(-len(arrivals) // 3)  # ceil: the rest is one last step


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "speeds,slowdowns,times",
    [
        # 4 steps at 1.0 / 1.2 / 3.0 s (probes of 1 step measure them by 3 s). At 4.0 the window
        # runs to 5.0: worker 1 is due at 4.8 and lands then, worker 2 is due at 12.0. The group
        # {0, 1} restarts at 4.8, when its last member landed, not at 5.0.
        ((1.0, 1.2, 3.0), (), [4.0, 4.8, 8.8, 9.6, 12.0]),
        # Worker 1 slowed 2x from 5 s: at 8.8 it is due at 9.6 (inside the window to 9.8) but
        # lands at 4.8 + 1.2 + 3 × 2.4 = 13.2, so worker 0 waits to the window's end, 9.8.
        ((1.0, 1.2), ("1:2@5-inf",), [4.0, 4.8, 8.8, 13.2, 13.8]),
    ],
)
def test_grace_group_restarts_when_its_last_expected_push_lands(tiny, tmp_path, speeds, slowdowns, times):
    cfg = tiny(
        method="async",
        num_workers=len(speeds),
        sim=SimConfig(speeds=speeds, slowdowns=slowdowns, procs=1),
        async_=AsyncConfig(**{**BARE, "grace_s": 1.0}),
        dylu=NO_DYLU,
    )
    train(cfg, progress=False)
    lines = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "worker"]
    assert [round(m["sim_time_s"], 6) for m in lines[: len(times)]] == times


def _dylu_run(tiny, tmp_path, name, server, sim, dylu=None):
    dylu = dylu or DyluConfig()
    cfg = tiny(method="async", num_workers=4, inner_steps=50, rounds=2, sim=sim, async_=server, dylu=dylu)
    cfg = dataclasses.replace(cfg, out=str(tmp_path / name), eval_every=0)
    summary = train(cfg, progress=False)
    return summary, [m for m in read_metrics(tmp_path / name) if m["kind"] == "worker"]


@pytest.mark.timeout(120)
def test_measured_dylu_sizes_the_first_jobs_like_the_oracle(tiny, tmp_path):
    # The benchmark's profile: each first job measures its speed on 5 steps (a tenth of H) and
    # only then gets its length, so no worker runs a full H from unmeasured speeds. On a fixed
    # profile the measured run is the oracle's, bit for bit.
    sim = SimConfig(speeds=SPEEDS, procs=1)
    measured, m_lines = _dylu_run(tiny, tmp_path, "measured", AsyncConfig(), sim)
    oracle, o_lines = _dylu_run(tiny, tmp_path, "oracle", AsyncConfig(), sim, DyluConfig(oracle=True))
    first = {m["worker"]: m["steps"] for m in reversed(m_lines)}
    assert [first[w] for w in range(4)] == [50, 38, 19, 8]
    assert all(m["staleness"] < 4 for m in m_lines)  # the slow worker's first push is not stale
    assert _equal(_params(tmp_path / "measured"), _params(tmp_path / "oracle"))
    assert [(m["worker"], m["steps"]) for m in m_lines] == [(m["worker"], m["steps"]) for m in o_lines]


@pytest.mark.timeout(120)
def test_on_a_fixed_profile_deadline_jobs_are_the_h_w_step_jobs(tiny, tmp_path):
    # Without jitter a deadline of H × the fastest speed fits exactly DyLU's H_w steps, and the
    # pushes land as they did: the same jobs and the same θ, bit for bit.
    sim = SimConfig(speeds=SPEEDS, procs=1)
    _, by_steps = _dylu_run(tiny, tmp_path, "steps", AsyncConfig(), sim, DyluConfig(by="steps"))
    _, by_time = _dylu_run(tiny, tmp_path, "time", AsyncConfig(), sim, DyluConfig(by="time"))
    assert [(m["worker"], m["steps"], m["sim_time_s"]) for m in by_time] == [
        (m["worker"], m["steps"], m["sim_time_s"]) for m in by_steps
    ]
    assert _equal(_params(tmp_path / "time"), _params(tmp_path / "steps"))


@pytest.mark.timeout(60)
def test_measured_speeds_follow_a_slowdown(tiny, tmp_path):
    # Worker 0 is 3x slower from 12 s on: its estimate (EMA, weight 0.5) climbs towards 3 s and
    # DyLU cuts its jobs to floor(1/3 × 6) = 2 steps while worker 1 keeps 6.
    cfg = tiny(
        method="async",
        inner_steps=6,
        rounds=8,
        sim=SimConfig(speeds=(1.0, 1.0), slowdowns=("0:3@12-inf",), procs=1),
        async_=AsyncConfig(shard_sampling=False),
    )
    train(cfg, progress=False)
    lines = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "worker"]
    w0 = [m for m in lines if m["worker"] == 0]
    assert w0[0]["steps"] == 6 and w0[-1]["speed_est_s"] > 2.5
    assert [m["steps"] for m in w0][-3:] == [2, 2, 2]
    assert all(m["steps"] == 6 for m in lines if m["worker"] == 1 and m["sim_time_s"] < 60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "dylu_by,times,steps",
    [
        # 1-step probes measure 1.0 and 2.5 s per step. H_w from speeds: worker 1 takes
        # ⌊1/2.5 · 4⌋ = 1 step and is due when it lands, at 2.5: its window (to 3.5) does not
        # wait for worker 0 (due at 4.0), so it restarts alone; worker 0's window (4.0 to 5.0)
        # catches worker 1's next push at 5.0, and the two drift apart again.
        ("steps", [2.5, 4.0, 5.0, 7.5, 9.0], [1, 4, 1, 1, 4]),
        # Deadlines of 4 × 1.0 s: worker 1 fits 1 step (a second would end at 5.0) and lands at
        # 2.5, but was due at its deadline, 4.0: the window opens then and takes worker 0's push
        # at 4.0; both restart at 4.0, and again at 8.0.
        ("time", [2.5, 4.0, 6.5, 8.0, 10.5], [1, 4, 1, 4, 1]),
    ],
)
def test_deadline_jobs_land_in_one_grace_group(tiny, tmp_path, dylu_by, times, steps):
    cfg = tiny(
        method="async",
        sim=SimConfig(speeds=(1.0, 2.5), procs=1),
        async_=AsyncConfig(**{**BARE, "grace_s": 1.0}),
        dylu=DyluConfig(by=dylu_by),
    )
    train(cfg, progress=False)
    lines = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "worker"]
    assert [round(m["sim_time_s"], 6) for m in lines[:5]] == times
    assert [m["steps"] for m in lines[:5]] == steps


@pytest.mark.timeout(60)
def test_a_deadline_job_handed_out_apart_ends_with_the_one_in_flight(tiny, tmp_path):
    # No grace period: each push restarts its worker alone. Worker 1 (2.5 s per step) lands at
    # 2.5; worker 0's deadline, 4.0, would leave it less than half a job (2 s), so it ends a job
    # later, at 8.0: 5.5 s, 2 steps, lands at 7.5. Worker 0 lands at 4.0 and ends with it, at
    # 8.0 (4 steps). From then on both end together at 12.0, 16.0, ... (worker 1 fits 1 step in
    # 4.5 s). Without alignment worker 1 would restart on its own phase every time (2.5, 5.0, ...).
    cfg = tiny(
        method="async",
        sim=SimConfig(speeds=(1.0, 2.5), procs=1),
        async_=AsyncConfig(**{**BARE, "grace_s": 0.0}),
        dylu=DyluConfig(by="time"),
    )
    train(cfg, progress=False)
    lines = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "worker"]
    assert [(m["worker"], round(m["sim_time_s"], 6), m["steps"]) for m in lines[:6]] == [
        (1, 2.5, 1),
        (0, 4.0, 4),
        (1, 7.5, 2),
        (0, 8.0, 4),
        (1, 10.0, 1),
        (0, 12.0, 4),
    ]


def _jitter_run(tiny, out, dylu: DyluConfig) -> list[int]:
    """The benchmark's profile with each job ±10% (4 workers, H = 20, 4 rounds): the pushes'
    staleness in the order they were applied."""
    sim = SimConfig(speeds=SPEEDS, speed_jitter=0.1, procs=1)
    cfg = tiny(method="async", num_workers=4, inner_steps=20, rounds=4, sim=sim, dylu=dylu, out=str(out))
    train(dataclasses.replace(cfg, eval_every=0), progress=False)
    return [m["staleness"] for m in read_metrics(out) if m["kind"] == "worker"]


@pytest.mark.timeout(120)
def test_with_jitter_deadline_jobs_keep_every_grace_group_whole(tiny, tmp_path):
    # The benchmark's profile with each job ±10%: jobs of H_w steps land up to a tenth of a job
    # apart and their groups split (a push then lands with staleness other than its place in a
    # whole group); deadline jobs land together, every group holds all 4 workers, and DN sees
    # each group as a synchronous round: staleness 0, 1, 2, 3 in every group.
    stale = {by: _jitter_run(tiny, tmp_path / by, DyluConfig(by=by)) for by in ("steps", "time")}
    whole = [0, 1, 2, 3] * (len(stale["time"]) // 4)
    assert len(stale["time"]) >= 12 and stale["time"][: len(whole)] == whole
    assert stale["steps"][: len(whole)] != [0, 1, 2, 3] * (len(whole) // 4)


@pytest.mark.timeout(120)
def test_with_deadline_jobs_dn_steps_its_momentum_at_each_groups_end(tiny, tmp_path, monkeypatch):
    # The jitter profile again: every group holds all 4 workers, so DN (N = 4) is told the 4th
    # arrival of each is its group's last, and steps its momentum there (nothing left in Δ).
    seen = []
    apply = DelayedNesterov.apply_parts  # what OuterSide.apply_async calls

    def recording(self, params, parts, **kw):
        changed = apply(self, params, parts, **kw)
        seen.append((kw["staleness"], kw["group_end"], self.at_group_end, self.count))
        return changed

    monkeypatch.setattr(DelayedNesterov, "apply_parts", recording)
    _jitter_run(tiny, tmp_path / "run", DyluConfig())
    whole = len(seen) // 4 * 4
    assert whole >= 12 and all(grouped for *_, grouped, _ in seen)
    assert [(s, end, n) for s, end, _, n in seen[:whole]] == [
        (s, s == 3, 0 if s == 3 else s + 1) for s in [0, 1, 2, 3] * (whole // 4)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "dylu",
    [DyluConfig(), DyluConfig(oracle=True), DyluConfig(by="time")],
    ids=["measured", "oracle", "deadlines"],
)
def test_async_with_equal_speeds_reduces_to_sync_diloco(tiny, tmp_path, dylu):
    # The paper's footnote: equal speeds, no jitter, DN with N = k and c = 0, DyLU and a grace
    # period give sync DiLoCo. Every worker's push lands at once, the grace group takes all k,
    # and DN's k arrivals sum to one Nesterov step on their mean. Each arrival is applied on its
    # own (DN is defined per arrival), so θ agrees up to float rounding, not bit for bit.
    sim = SimConfig(speeds=(1.0, 1.0), procs=1)
    sync = train(tiny(sim=sim, out=str(tmp_path / "sync")), progress=False)
    server = AsyncConfig(shard_sampling=False)
    asyn = train(
        tiny(method="async", sim=sim, async_=server, dylu=dylu, out=str(tmp_path / "async")), progress=False
    )
    a, b = _params(tmp_path / "async"), _params(tmp_path / "sync")
    diff = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    norm = sum(float(b[k].pow(2).sum()) for k in b) ** 0.5
    assert 0 < diff / norm <= 1e-6
    assert asyn["sim_time_s"] == sync["sim_time_s"]
    assert asyn["val_loss"] == pytest.approx(sync["val_loss"], rel=1e-5)


@pytest.mark.timeout(60)
def test_without_grace_pushes_landing_together_are_not_grouped(tiny, tmp_path):
    # Equal speeds: both pushes land at 4.0. Without a grace period worker 0 (first on ties) is
    # restarted before worker 1's push is applied, so its next push is one version stale; a
    # grace period groups them and both restart from the same θ.
    stale = {}
    for grace in (0.0, 1.0):
        cfg = tiny(
            method="async",
            sim=SimConfig(speeds=(1.0, 1.0), procs=1),
            async_=AsyncConfig(**{**BARE, "grace_s": grace}),
            dylu=NO_DYLU,
            out=str(tmp_path / f"g{grace}"),
        )
        train(cfg, progress=False)
        lines = [m for m in read_metrics(tmp_path / f"g{grace}") if m["kind"] == "worker"]
        stale[grace] = [m["staleness"] for m in lines if m["worker"] == 0][1]
    assert stale == {0.0: 1, 1.0: 0}


@pytest.mark.timeout(60)
def test_async_summary_with_workers_of_different_speeds_counts_each_one(tiny):
    """Workers of very different speeds push different numbers of jobs and steps: the summary
    lists each worker's steps, and every figure of the bytes line is a mean over the k workers,
    so the ratio is the printed data parallel bytes over the printed bytes."""
    cfg = tiny(method="async", num_workers=3, inner_steps=10, rounds=6, sim=SimConfig(speeds=(0.5, 1.5, 4.0)))
    summary = train(cfg, progress=False)
    each = summary["inner_steps_per_worker"]
    assert each[0] > each[1] > each[2] > 0 and summary["inner_steps"] == 3 * 6 * 10
    check_summary(summary, cfg.out, tokens_per_step=4 * 32, inner_steps=10)


@pytest.mark.timeout(60)
def test_a_worker_the_budget_left_idle_gets_the_steps_a_deadline_job_gave_back(tiny, tmp_path):
    # Near the budget's end (16 steps) worker 1 asks at 7.2 s and finds no room: worker 0's
    # deadline job in flight holds its reservation. That job (jitter 0.2) fits fewer steps than
    # reserved; when it lands at 10.5 s the steps it gave back go to worker 1 at once, as a job
    # of exactly what is left, so the run takes its whole budget (docs/async.md, "The budget's end").
    cfg = tiny(
        method="async",
        inner_steps=4,
        rounds=2,
        seed=3,
        eval_every=0,
        sim=SimConfig(speeds=(1.0, 1.3), speed_jitter=0.2, procs=1),
    )
    train(cfg, progress=False)
    lines = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "worker"]
    assert sum(m["steps"] for m in lines) == 2 * 2 * 4
    w0_last = max(m["sim_time_s"] for m in lines if m["worker"] == 0)
    last = lines[-1]
    assert (last["worker"], last["steps"]) == (1, 1)
    assert 0.8 * 1.3 <= last["sim_time_s"] - w0_last <= 1.2 * 1.3  # handed out as worker 0 landed
