"""The parameter server's state as a function of its event log: pure PyTorch and bookkeeping, no
sockets and no clock.

Every change of the server's state is an event (a small dict, `kind` plus fields) passed to
`Coordinator.apply`, in the order the server logged it:

    join     {worker, name, device, nonce}      a worker takes a free slot, as a fresh worker
    leave    {worker, reason}                   it left or its lease ran out; its job is abandoned
    begin    {round, members}                   sync: a round starts with these workers (with DyLU
                                                their steps are planned now, from the state)
    dispatch {job, worker, steps, shard, lr_step, position, version, lr_stride, seconds}   a job
                                                is handed out (θ copied now); with `seconds` a
                                                deadline job, `steps` the steps it reserves
    push     {job, worker, steps, loss, lr, compute_s, finite, nbytes, norm}   + the encoded outer_grad
                                                (`steps`: what it took; a deadline job's may
                                                differ from those reserved, which are corrected)
    reject   {job, worker, reason, detail, abandon, steps}   a push refused by validation
                                                (handlers.py); θ is untouched; with `abandon` the
                                                job, the pusher's own, is given back as on a leave
    close    {round}                            sync: the outer step on what arrived
    apply    {job, group_end}                   async: one arrived outer_grad applied by the rule
                                                (group_end: the last of its grace group)
    late     {job, worker, steps}               a worker pushed a job already abandoned (replay
                                                computes it: the worker did, `ran_steps` of it)
    flush    {}                                 async: the end; a rule's held-back updates applied

Decisions that need the clock or the network (which slot a worker gets, how many steps a job
has, which shard, when a round or a grace window closes) are made by the server (service.py)
with the `plan_*` helpers here and written into the events, so applying the same events gives
the same state bit for bit: that is how the server recovers after a crash (checkpoint + the
write-ahead log) and how `diloco replay` re-runs a server run in one process (replay.py).

    python -m pytest tests/integration/test_server.py
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from typing import Any

from diloco.config import TrainConfig
from diloco.core.async_policy import (
    SpeedEstimator,
    aligned_job_s,
    dylu_steps,
    grace_period,
    job_seconds,
    probe_steps,
    shard_probabilities,
)
from diloco.core.async_rules import DelayComp
from diloco.core.codec import Encoded
from diloco.core.dylu import DEADLINE_CAP, RoundPlan, RoundPlanner
from diloco.core.outer_side import OuterSide
from diloco.runtime import Arrival, RoundStats
from diloco.runtime.server import snapshot
from diloco.runtime.server.jobs import Job

NORM_WINDOW = 16  # --max-update-norm-ratio compares with the median of this many accepted pushes
NORM_MIN = 4  # ... once there are at least this many


class Coordinator:
    """The server's state (see the module docstring); `side` holds θ and the outer update."""

    def __init__(self, cfg: TrainConfig, side: OuterSide, shard_sizes: list[int]):
        self.cfg, self.side = cfg, side
        self.k, self.H = cfg.num_workers, cfg.inner_steps
        self.sync = cfg.method == "diloco"
        self.shard_sizes = list(shard_sizes)
        self.step_budget = self.k * cfg.total_inner_steps  # async: inner steps over all workers
        self.seq = 0  # events applied
        self.workers: dict[int, dict[str, Any]] = {}  # registered, by slot
        self.jobs: dict[int, Job] = {}  # handed out, not pushed or abandoned
        self.pushed: dict[int, int] = {}  # job -> worker, for accepted pushes (a retry is a duplicate)
        self.norms: deque[float] = deque(maxlen=NORM_WINDOW)  # recent accepted outer_grad norms per √step
        self.rejected: dict[str, int] = {}  # refused pushes by reason
        self.late: set[int] = set()  # abandoned jobs whose push came anyway (logged once)
        self.next_job = 0
        self.shard_steps = [0] * len(shard_sizes)
        self.dispatched = 0  # async: inner steps handed out (an abandoned job's are given back)
        self.applied = 0  # async: inner steps whose outer_grad was applied
        self.members: list[int] = []  # sync: this round's workers ([] between rounds)
        self.round_t = 0.0  # sync: when this round began
        self.inbox: dict[int, tuple[dict, Encoded]] = {}  # sync: this round's pushes, by worker
        self.arrived: list[tuple[dict, Encoded, Job]] = []  # async: accepted, not applied, in order
        self.flushed = False
        # sync DiLoCo with DyLU (core/dylu.py): each round's H_w from the members' measured speeds
        dylu = self.sync and cfg.dylu.on(cfg.method)
        self.planner = RoundPlanner(self.k, self.H, self.step_budget, alpha=cfg.dylu.alpha) if dylu else None
        self.plan: RoundPlan | None = None  # this round's
        # per slot, over the whole run: jobs, inner steps, compute seconds, staleness
        self.totals = [
            {"jobs": 0, "steps": 0, "compute_s": 0.0, "staleness": 0, "present_s": 0.0, "step_s": None}
            for _ in range(self.k)
        ]

    # -- what the server reads -----------------------------------------------------------------
    @property
    def finished(self) -> bool:
        if self.planner is not None:
            return self.planner.done and not self.members
        return self.side.rounds_done >= self.cfg.rounds if self.sync else self.flushed

    def known(self, w: int, token: int) -> bool:
        """Whether worker w is registered, as the registration that got `token`."""
        return w in self.workers and self.workers[w]["token"] == token

    def norm_bound(self, ratio: float) -> float | None:
        """The largest outer_grad norm per √step accepted now: `ratio` × the median of the recent
        accepted ones (None: no bound, when ratio is 0 or too few were accepted yet)."""
        if not ratio or len(self.norms) < NORM_MIN:
            return None
        return ratio * statistics.median(self.norms)

    def free_slot(self) -> int | None:
        return next((w for w in range(self.k) if w not in self.workers), None)

    def idle(self) -> list[int]:
        """Registered workers with no job and no outer_grad waiting to be applied."""
        waiting = {job.worker for _, _, job in self.arrived}
        return [w for w, rec in sorted(self.workers.items()) if rec["job"] is None and w not in waiting]

    def plan_dispatch(self, w: int, now: float = 0.0) -> dict[str, Any] | None:
        """The next job of worker w, handed out at time `now` (None: the async budget is handed
        out). Sync: H steps on its own shard. Async (Algorithm 2): a first job measures the
        worker's speed on H/10 steps; later ones have H_w = max(1, ⌊fastest s/step ÷ its s/step
        × H⌋) steps (DyLU), or with jobs as deadlines end with the deadline jobs in flight
        (`aligned_job_s`), on a shard sampled by p_i ∝ max(|D_i|/Σ|D| − n_i/Σn, 0) (shard
        sampling), else its own."""
        v, job = self.cfg.async_, self.next_job
        steps, shard, lr_stride, seconds = self.H, w, 1.0, None
        if self.plan is not None:  # sync DiLoCo with DyLU: planned at the round's begin
            steps, lr_stride = self.plan.steps[w], self.plan.lr_strides[w]
        if not self.sync:
            measured = {i: r["step_s"] for i, r in self.workers.items() if r["step_s"] is not None}
            dylu = self.cfg.dylu.on(self.cfg.method)
            if dylu and w not in measured:
                steps = probe_steps(self.H)
            elif (
                dylu and self.cfg.dylu.by_for("async") == "time"
            ):  # a deadline; it reserves the steps expected to fit
                ends = [j.t + j.seconds for j in self.jobs.values() if j.seconds is not None]
                seconds = aligned_job_s(now, job_seconds(self.H, list(measured.values())), ends)
                steps = max(1, math.floor(seconds / measured[w] * (1 + 1e-9)))
            elif dylu:
                steps = dylu_steps(list(measured.values()), self.H)[list(measured).index(w)]
            if steps > self.step_budget - self.dispatched:  # the budget's end: a job of exact steps
                steps, seconds = self.step_budget - self.dispatched, None
            if steps <= 0:
                return None
            if v.shard_sampling:
                probs = shard_probabilities(self.shard_sizes, self.shard_steps)
                rng = random.Random(f"shard/{self.cfg.seed}/{job}")  # no state to save or replay
                shard = rng.choices(range(len(probs)), weights=probs)[0]
        return {
            "kind": "dispatch",
            "job": job,
            "worker": w,
            "steps": steps,
            "shard": shard,
            # sync: the round drives the lr, so a worker that joins mid-run takes the run's lr;
            # async: the shard's own step count does (docs/method.md §2)
            "lr_step": (self.plan.lr_step if self.plan else self.side.inner_step)
            if self.sync
            else self.shard_steps[shard],
            "position": self.shard_steps[shard],
            "version": self.side.version,
            "lr_stride": lr_stride,
            "seconds": seconds,
        }

    def grace_s(self) -> float:
        """The grace period: `grace_s`, or for "auto" a tenth of a job, H × the fastest measured
        seconds per step (0 while none is measured)."""
        known = [r["step_s"] for r in self.workers.values() if r["step_s"] is not None]
        return grace_period(self.cfg.async_.grace_s, self.H, known)

    def due(self, job: Job) -> float | None:
        """When the server expects job's push: a deadline job's deadline, else from its worker's
        measured speed (None: unknown)."""
        if job.seconds is not None:
            return job.t + job.seconds
        speed = self.workers.get(job.worker, {}).get("step_s")
        return None if speed is None else job.t + job.steps * speed

    @staticmethod
    def ran_steps(job: Job, claimed: int | None) -> int:
        """The steps a worker ran of `job`: a deadline job's as its push says, when that is
        possible (1 to DEADLINE_CAP × those reserved; a refused push may claim anything), else
        the job's own."""
        if job.seconds is not None and claimed is not None and 1 <= claimed <= DEADLINE_CAP * job.steps:
            return claimed
        return job.steps

    # -- events --------------------------------------------------------------------------------
    def apply(self, event: dict[str, Any], message: Encoded | None = None) -> Any:
        """Apply one event (its `seq` must follow the last one); returns a close's RoundStats or
        an apply's Arrival, else None."""
        if event["seq"] != self.seq + 1:
            raise ValueError(f"event {event['seq']} does not follow event {self.seq}")
        out = getattr(self, "_on_" + event["kind"])(event, message)
        self.seq = event["seq"]
        return out

    def _on_join(self, e, _):
        w = e["worker"]
        if w in self.workers or not 0 <= w < self.k:
            raise ValueError(f"worker {w} cannot join")
        self.workers[w] = {
            "name": e["name"],
            "device": e["device"],
            "job": None,
            "step_s": None,  # measured seconds per inner step (EMA), None before its first push
            "joined_t": e["t"],
            "token": e["seq"],  # this registration: calls of an earlier holder of the slot are refused
            "nonce": e.get("nonce", ""),
        }

    def _on_leave(self, e, _):
        rec = self.workers.pop(e["worker"])
        tot = self.totals[e["worker"]]
        tot["present_s"] += e["t"] - rec["joined_t"]
        tot["step_s"] = rec["step_s"]
        job = self.jobs.pop(rec["job"], None) if rec["job"] is not None else None
        if job is not None and not self.sync:
            self.dispatched -= job.steps  # re-offered to the others

    def _on_begin(self, e, _):
        members = list(e["members"])
        if self.planner is not None:  # a member not measured yet makes it a round of H for all
            speeds = [self.workers[w]["step_s"] if w in self.workers else None for w in range(self.k)]
            self.plan = self.planner.plan(speeds, members)
        self.side.begin_round(members, steps=self.plan.steps if self.plan else None)  # counts the downloads
        self.members, self.inbox, self.round_t = members, {}, e["t"]

    def _on_dispatch(self, e, _):
        w, job = e["worker"], e["job"]
        position = e.get("position", e["lr_step"])  # logs of protocol 2 had one number for both
        fits = job == self.next_job and e["version"] == self.side.version
        if not fits or position != self.shard_steps[e["shard"]]:
            raise ValueError(f"dispatch of job {job} does not fit the state it follows")
        if not self.sync:
            self.side.pull(w)  # counts the download (sync: counted by begin)
        pulled = [p.detach().clone() for p in self.side.downloaded()]
        self.jobs[job] = Job(
            job,
            w,
            e["steps"],
            e["shard"],
            e["lr_step"],
            position,
            e["version"],
            e["t"],
            pulled,
            e.get("lr_stride", 1.0),
            e.get("seconds"),
        )
        self.workers[w]["job"] = job
        self.next_job = job + 1
        self.shard_steps[e["shard"]] += e["steps"]
        self.dispatched += e["steps"]

    def _on_push(self, e, message):
        job = self.jobs.pop(e["job"])
        if e["steps"] != job.steps:  # a deadline job took other than it reserved: count what it took
            taken = self.ran_steps(job, e["steps"])
            self.dispatched += taken - job.steps
            self.shard_steps[job.shard] += taken - job.steps
            job.steps = taken
        self.pushed[job.job] = job.worker
        if e.get("norm") is not None:
            self.norms.append(e["norm"])
        rec = self.workers[job.worker]
        rec["job"] = None
        speed = SpeedEstimator(self.cfg.dylu.alpha)  # the EMA; its value lives in the record
        speed.step_s = rec["step_s"]
        rec["step_s"] = speed.update(e["compute_s"], job.steps)
        tot = self.totals[job.worker]
        tot["jobs"] += 1
        tot["steps"] += job.steps
        tot["compute_s"] += e["compute_s"]
        tot["last_steps"] = job.steps
        if self.sync:
            self.inbox[job.worker] = (e, message)
        else:
            self.arrived.append((e, message, job))

    def _on_close(self, e, _):
        side, messages, losses, ids, lr = self.side, {}, [], [], 0.0
        for w in self.members:  # in worker order, as every runtime reports
            if w in self.inbox:
                push, message = self.inbox[w]
                counts = side.report(w, message.nbytes, push["finite"])
                messages[w] = message if counts else None
                ids.append(w)
                losses.append(push["loss"])
                lr = push["lr"]
            else:
                side.report(w, 0, lost=True)  # late or gone: dropped, it rejoins from θ
        advance, steps = self.H, None
        if self.plan is not None:  # the budget counts the steps that arrived
            steps = [self.plan.steps[w] for w in ids]
            advance = self.planner.spend(sum(steps))
            self.plan = None
        side.end_round(side.reduce([messages.get(w) for w in range(self.k)]), advance)
        for job in list(self.jobs.values()):  # the late ones' jobs are abandoned
            del self.jobs[job.job]
            self.workers[job.worker]["job"] = None
        self.members, self.inbox = [], {}
        return RoundStats(
            side.version,
            side.inner_step,
            losses,
            lr,
            list(side.bytes_sent),
            list(side.bytes_received),
            workers=ids,
            steps=steps,
        )

    def _on_apply(self, e, _):
        i = next(i for i, (push, _, _) in enumerate(self.arrived) if push["job"] == e["job"])
        push, message, job = self.arrived.pop(i)
        staleness = self.side.version - job.version
        pulled = job.pulled if isinstance(self.side.update, DelayComp) else None
        flags = {"finite": push["finite"], "pulled": pulled, "group_end": e.get("group_end", True)}
        changed = self.side.apply_async(job.worker, message, steps=job.steps, staleness=staleness, **flags)
        self.applied += job.steps
        self.totals[job.worker]["staleness"] += staleness
        self.totals[job.worker]["last_staleness"] = staleness
        speed = self.workers.get(job.worker, {}).get("step_s")
        return Arrival(
            job.worker, job.steps, staleness, changed, push["loss"], push["lr"], job.shard, speed, e["t"]
        )

    def _on_reject(self, e, _):
        self.rejected[e["reason"]] = self.rejected.get(e["reason"], 0) + 1
        if e["abandon"]:
            job = self.jobs.pop(e["job"])
            self.workers[job.worker]["job"] = None
            if not self.sync:
                self.dispatched -= job.steps  # re-offered, as a departed worker's

    def _on_late(self, e, _):
        self.late.add(e["job"])

    def _on_flush(self, e, _):
        self.side.flush()
        self.flushed = True

    # -- checkpoints: runtime/server/snapshot.py -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything but θ and the outer update, between rounds (snapshot.save)."""
        return snapshot.save(self)

    def load_state_dict(self, s: dict[str, Any]) -> None:
        snapshot.load(self, s)
