"""The server's state machine without the network: events in, state out, compared with a hand
computation, and the same state after a checkpoint and the rest of the events."""

from __future__ import annotations

import copy

import pytest
import torch

from diloco.config import AsyncConfig, DyluConfig, SimConfig
from diloco.core.async_rules import build_async_rule
from diloco.core.codec import Fp32Codec
from diloco.core.outer import Nesterov
from diloco.core.outer_side import OuterSide
from diloco.model.gpt import GPT
from diloco.runtime.server.coordinator import Coordinator


def make(tiny, *, method="diloco", k=2, dylu=None, **server):
    cfg = tiny(
        method=method,
        num_workers=k,
        runtime="server",
        async_=AsyncConfig(**server),
        dylu=DyluConfig(enabled=dylu),
        sim=SimConfig(),
        checkpoint_every=1,
    )
    torch.manual_seed(0)
    model = GPT(cfg.model)
    rule = Nesterov() if method == "diloco" else build_async_rule("dn", lr=0.7, momentum=0.9, num_workers=k)
    side = OuterSide(model, k, update=rule, weights=[0.25, 0.75] if method == "diloco" else None)
    return Coordinator(cfg, side, [1000] * k)


class Log:
    """Numbers events as the server does."""

    def __init__(self, coord):
        self.coord, self.t = coord, 100.0

    def __call__(self, event, message=None):
        self.t += 1.0
        return self.coord.apply({**event, "seq": self.coord.seq + 1, "t": self.t}, message)


def outer_grad(coord, scale):
    return [torch.full_like(p, scale) for p in coord.side.params]


def push(log, job, worker, grad, compute_s=1.0, steps=4):
    message = Fp32Codec().encode(grad)
    event = {
        "kind": "push",
        "job": job,
        "worker": worker,
        "steps": steps,
        "loss": 1.0,
        "lr": 1e-3,
        "compute_s": compute_s,
        "finite": True,
        "nbytes": message.nbytes,
    }
    log(event, message)


def first_round(tiny):
    """Workers 0 and 1 join and get the first sync round's jobs; θ before it."""
    coord = make(tiny)
    log = Log(coord)
    before = [p.detach().clone() for p in coord.side.params]
    for w in (0, 1):
        log({"kind": "join", "worker": w, "name": f"w{w}", "device": "cpu"})
    log({"kind": "begin", "round": 1, "members": [0, 1]})
    for w in (0, 1):
        log(coord.plan_dispatch(w))
    return coord, log, before


def assert_one_nesterov_step(coord, before, grad):
    """θ is `before` after one step of torch's SGD with Nesterov momentum on `grad` alone."""
    ref = [b.clone().requires_grad_() for b in before]
    opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for r, g in zip(ref, grad):
        r.grad = g.clone()
    opt.step()
    for p, r in zip(coord.side.params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_a_sync_round_without_one_worker_renormalises_the_weights(tiny):
    """Worker 1 (weight 0.75) times out: worker 0's outer_grad gets weight 1, as torch's SGD with
    Nesterov momentum computes it."""
    coord, log, before = first_round(tiny)
    assert [j.lr_step for j in coord.jobs.values()] == [0, 0] and coord.shard_steps == [4, 4]
    grad = outer_grad(coord, 0.01)
    push(log, 0, 0, grad)
    stats = log({"kind": "close", "round": 1})
    assert stats.workers == [0] and coord.side.version == 1 and coord.jobs == {}
    assert_one_nesterov_step(coord, before, grad)
    assert coord.side.own_start == [False, False]  # the late worker rejoins from θ


@pytest.mark.timeout(60)
def test_a_worker_joining_a_sync_run_late_takes_the_rounds_lr_and_its_shards_position(tiny):
    """Worker 1 joins for round 2: its job's lr step is the round's (H, as worker 0's), not a
    fresh warm-up from 0; its batches start where its shard stands (0)."""
    coord = make(tiny)
    log = Log(coord)
    H = coord.H
    log({"kind": "join", "worker": 0, "name": "w0", "device": "cpu"})
    log({"kind": "begin", "round": 1, "members": [0]})
    log(coord.plan_dispatch(0))
    push(log, 0, 0, outer_grad(coord, 0.01), steps=H)
    log({"kind": "close", "round": 1})
    log({"kind": "join", "worker": 1, "name": "w1", "device": "cpu"})
    log({"kind": "begin", "round": 2, "members": [0, 1]})
    for w in (0, 1):
        log(coord.plan_dispatch(w))
    jobs = sorted(coord.jobs.values(), key=lambda j: j.worker)
    assert [(j.lr_step, j.position) for j in jobs] == [(H, H), (H, 0)]
    assert coord.shard_steps == [2 * H, H]


@pytest.mark.timeout(60)
def test_async_jobs_probe_then_follow_measured_speeds(tiny):
    """A first job is the probe (H/10 steps); then H_w = ⌊fastest/own s per step × H⌋; the budget
    caps the last job; an abandoned job's steps are offered again."""
    coord = make(tiny, method="async", k=2, shard_sampling=False)
    log = Log(coord)
    H = coord.H  # 4: the probe is 1 step
    for w in (0, 1):
        log({"kind": "join", "worker": w, "name": f"w{w}", "device": "cpu"})
        log(coord.plan_dispatch(w))
    assert [j.steps for j in coord.jobs.values()] == [1, 1]
    push(log, 0, 0, outer_grad(coord, 0.0), compute_s=0.5, steps=1)
    push(log, 1, 1, outer_grad(coord, 0.0), compute_s=2.0, steps=1)
    assert coord.idle() == []  # pushed, not applied: not handed a job yet
    for job in (0, 1):
        log({"kind": "apply", "job": job})
    assert coord.plan_dispatch(0)["steps"] == H and coord.plan_dispatch(1)["steps"] == H // 4
    log(coord.plan_dispatch(1))
    log({"kind": "leave", "worker": 1, "reason": "expired"})
    assert coord.dispatched == 2  # its job's step went back
    coord.dispatched = coord.step_budget - 3
    assert coord.plan_dispatch(0)["steps"] == 3


@pytest.mark.timeout(60)
def test_deadline_jobs_handed_out_apart_end_together(tiny):
    """Jobs as deadlines (async's default). Worker 0 measures 2 s per step and gets a job of
    H × 2 = 8 s at 107, to 115. Worker 1's probe lands later; handed out at 110, its job ends
    with worker 0's, at 115 (5 s, more than half a job), so their pushes land in one grace
    group. Worker 0's next job, handed out at 113, 2 s before worker 1's deadline (less than
    half a job), ends a whole job after it, at 123."""
    coord = make(tiny, method="async", k=2, shard_sampling=False)
    log = Log(coord)  # each event 1 s after the last, from 101
    for w in (0, 1):
        log({"kind": "join", "worker": w, "name": f"w{w}", "device": "cpu"})
        log(coord.plan_dispatch(w, log.t + 1))
    push(log, 0, 0, outer_grad(coord, 0.0), compute_s=2.0, steps=1)
    log({"kind": "apply", "job": 0})
    log(coord.plan_dispatch(0, log.t + 1))
    push(log, 1, 1, outer_grad(coord, 0.0), compute_s=4.0, steps=1)
    log({"kind": "apply", "job": 1})
    log(coord.plan_dispatch(1, log.t + 1))
    w0, w1 = sorted(coord.jobs.values(), key=lambda j: j.worker)
    assert (w0.t, w0.seconds, coord.due(w0)) == (107.0, 8.0, 115.0)
    assert (w1.t, w1.seconds, coord.due(w1)) == (110.0, 5.0, 115.0)
    push(log, w0.job, 0, outer_grad(coord, 0.0), compute_s=4.0, steps=2)
    log({"kind": "apply", "job": w0.job})
    log(coord.plan_dispatch(0, log.t + 1))
    w0 = next(j for j in coord.jobs.values() if j.worker == 0)
    assert (w0.t, w0.seconds, coord.due(w0)) == (113.0, 10.0, 123.0)


@pytest.mark.timeout(60)
def test_a_deadline_jobs_cap_keeps_the_run_to_its_budget(tiny):
    """A deadline job reserves the steps expected to fit and may take up to DEADLINE_CAP × them,
    but that headroom comes only from room no other worker needs for its next job (`budget_job`):
    near the budget's end every worker still gets its job, none waits for another's headroom to
    come back, and the last job takes exactly what is left."""
    coord = make(tiny, method="async", k=2, shard_sampling=False)
    log = Log(coord)
    for w in (0, 1):
        log({"kind": "join", "worker": w, "name": f"w{w}", "device": "cpu"})
        log(coord.plan_dispatch(w, log.t + 1))
    for w in (0, 1):  # both measure 2 s per step: jobs of H × 2 s = 8 s, 4 steps each
        push(log, w, w, outer_grad(coord, 0.0), compute_s=2.0, steps=1)
        log({"kind": "apply", "job": w})
    coord.dispatched = coord.step_budget - 10  # 10 steps left
    first = coord.plan_dispatch(0, log.t + 1)  # 4 reserved, 4 kept for worker 1: 2 of headroom
    assert (first["steps"], first["seconds"], first["cap"]) == (4, 8.0, 6)
    log(first)
    # a second later it ends with the first (7 s, 3 steps); room 10 − 4 − 2 = 4 holds its whole
    # job but no headroom (4 is kept for worker 0's next)
    second = coord.plan_dispatch(1, log.t + 1)
    assert (second["steps"], second["seconds"], second["cap"]) == (3, 7.0, 3)
    log(second)
    push(log, first["job"], 0, outer_grad(coord, 0.0), compute_s=10.0, steps=5)  # 5 of its 6
    push(log, second["job"], 1, outer_grad(coord, 0.0), compute_s=8.0, steps=2)  # 2 of its 3
    for job in (first["job"], second["job"]):
        log({"kind": "apply", "job": job})
    last = coord.plan_dispatch(0, log.t + 1)  # 10 − 5 − 2 = 3 left: a job of exactly 3
    assert (last["steps"], last["seconds"], "cap" in last) == (3, None, False)
    assert coord.dispatched + last["steps"] == coord.step_budget


@pytest.mark.timeout(60)
def test_an_apply_event_says_whether_it_ends_its_grace_group(tiny):
    """DN of a run with deadline jobs steps its momentum at a group's end: the apply event carries
    it (the server knows its groups), so replaying the log steps at the same arrivals."""
    coord = make(tiny, method="async", k=2, shard_sampling=False)
    coord.side.update = build_async_rule("dn", lr=0.7, momentum=0.9, num_workers=2, at_group_end=True)
    log = Log(coord)
    for w in (0, 1):
        log({"kind": "join", "worker": w, "name": f"w{w}", "device": "cpu"})
        log(coord.plan_dispatch(w, log.t + 1))
    for w in (0, 1):
        push(log, w, w, outer_grad(coord, 0.01 * (w + 1)), steps=1)
    log({"kind": "apply", "job": 0, "group_end": False})
    assert coord.side.update.count == 1
    log({"kind": "apply", "job": 1, "group_end": True})  # 2 = N arrivals, the group's last: the step
    assert coord.side.update.count == 0 and coord.side.version == 2


@pytest.mark.timeout(60)
def test_state_after_a_checkpoint_and_the_rest_of_the_log_is_the_same(tiny):
    """Crash recovery in its pure form: checkpoint mid-run, load it into a new coordinator, apply
    the remaining events: the same θ, bit for bit, as applying them all to one."""

    def run(coord, cut=None):
        log, states = Log(coord), []
        script = []
        for w in (0, 1):
            script.append(({"kind": "join", "worker": w, "name": "w", "device": "cpu"}, None))
        for r in range(3):
            script.append(({"kind": "begin", "round": r + 1, "members": [0, 1]}, None))
            for w in (0, 1):
                script.append(("dispatch", w))
            for w in (0, 1):
                script.append(("push", (2 * r + w, w, 0.01 * (r + 1) * (w + 1))))
            script.append(({"kind": "close", "round": r + 1}, None))
        for i, (event, arg) in enumerate(script):
            if i == cut:
                states.append(copy.deepcopy((coord.state_dict(), coord.side.state_dict())))
                fresh = make(tiny)
                fresh.load_state_dict(states[-1][0])
                fresh.side.load_state_dict(states[-1][1])
                coord = fresh
                log = Log(coord)
                log.t = 100.0 + i
            if event == "dispatch":
                log(coord.plan_dispatch(arg))
            elif event == "push":
                job, w, scale = arg
                push(log, job, w, outer_grad(coord, scale))
            else:
                log(event)
        return coord

    whole = run(make(tiny))
    resumed = run(make(tiny), cut=8)  # between rounds 1 and 2, where the server checkpoints
    for a, b in zip(whole.side.params, resumed.side.params):
        assert torch.equal(a, b)
    assert whole.side.version == resumed.side.version == 3


@pytest.mark.timeout(30)
def test_events_out_of_order_or_off_the_state_are_refused(tiny):
    coord = make(tiny)
    with pytest.raises(ValueError, match="does not follow"):
        coord.apply({"kind": "join", "worker": 0, "name": "w", "device": "cpu", "seq": 2, "t": 0.0})
    log = Log(coord)
    log({"kind": "join", "worker": 0, "name": "w", "device": "cpu"})
    with pytest.raises(ValueError, match="does not fit"):
        log({**coord.plan_dispatch(0), "version": 5})
    log({"kind": "begin", "round": 1, "members": [0]})
    with pytest.raises(RuntimeError, match="between rounds"):
        coord.state_dict()


@pytest.mark.timeout(60)
def test_async_rules_get_staleness_and_the_pulled_parameters(tiny):
    """Any async rule runs on the server as in the simulator: delay compensation, which needs the
    parameters a job started from and its staleness, matches the rule applied by hand."""
    coord = make(tiny, method="async", k=2, dylu=False, shard_sampling=False, rule="delaycomp")
    coord.side.update = build_async_rule("delaycomp", lr=0.7, momentum=0.9, num_workers=2)
    reference = build_async_rule("delaycomp", lr=0.7, momentum=0.9, num_workers=2)
    theta = [p.detach().clone() for p in coord.side.params]
    log = Log(coord)
    for w in (0, 1):
        log({"kind": "join", "worker": w, "name": f"w{w}", "device": "cpu"})
        log(coord.plan_dispatch(w))
    pulled = [t.clone() for t in theta]  # both jobs start from version 0
    for job, w, scale in ((0, 0, 0.01), (1, 1, -0.02)):
        grad = outer_grad(coord, scale)
        push(log, job, w, grad)
        arrival = log({"kind": "apply", "job": job})
        assert arrival.staleness == job  # the second was pulled before the first applied
        reference.apply(theta, grad, worker=w, staleness=job, pulled=pulled)
    for p, r in zip(coord.side.params, theta):
        assert torch.equal(p, r)


@pytest.mark.timeout(60)
def test_a_refused_push_gives_its_job_back_and_only_its_own(tiny):
    """A `reject` of the pusher's own job (abandon) is a departure without leaving: the round
    closes without that outer_grad, as for a timeout; a reject of anyone else's job changes no
    job. Counts, accepted norms and the norm bound survive a checkpoint."""
    coord, log, before = first_round(tiny)
    grad = outer_grad(coord, 0.01)
    push(log, 0, 0, grad)
    log({"kind": "reject", "job": 1, "worker": 1, "reason": "norm", "detail": "big", "abandon": True})
    assert coord.jobs == {} and coord.workers[1]["job"] is None and coord.rejected == {"norm": 1}
    assert log({"kind": "close", "round": 1}).workers == [0]
    assert_one_nesterov_step(coord, before, grad)

    log({"kind": "begin", "round": 2, "members": [0, 1]})
    for w in (0, 1):
        log(coord.plan_dispatch(w))
    jobs = dict(coord.jobs)
    log({"kind": "reject", "job": 2, "worker": 1, "reason": "not_yours", "detail": "x", "abandon": False})
    assert coord.jobs == jobs and coord.rejected == {"norm": 1, "not_yours": 1}

    assert coord.norm_bound(10.0) is None  # no accepted norm yet
    coord.norms.extend([1.0, 2.0, 3.0])
    assert coord.norm_bound(10.0) is None  # fewer than 4
    coord.norms.append(4.0)
    assert coord.norm_bound(10.0) == 25.0 and coord.norm_bound(0.0) is None
    for j, w in ((2, 0), (3, 1)):
        push(log, j, w, grad)
    log({"kind": "close", "round": 2})
    fresh = make(tiny)
    fresh.load_state_dict(copy.deepcopy(coord.state_dict()))
    assert (fresh.rejected, list(fresh.norms)) == (coord.rejected, list(coord.norms))
    assert fresh.pushed == {0: 0, 2: 0, 3: 1}
