"""The parameter server's state as a function of its event log: pure PyTorch and bookkeeping, no
sockets and no clock.

Every change of the server's state is an event (a small dict, `kind` plus fields) passed to
`Coordinator.apply`, in the order the server logged it:

    join     {worker, name, device, nonce, [ranks, group]}   a worker takes a free slot, as a
                                                fresh worker (a torchrun group: its ranks, launch)
    leave    {worker, reason}                   it left, its lease ran out, or torchrun restarted
                                                its group; its job is abandoned
    begin    {round, members}                   sync: a round starts with these workers (with DyLU
                                                their steps are planned now, from the state)
    dispatch {job, worker, steps, shard, lr_step, position, version, lr_stride, seconds, cap}
                                                a job is handed out (θ copied now); with `seconds`
                                                a deadline job, `steps` the steps it reserves and
                                                `cap` the most it may take (the budget's room)
    push     {job, worker, steps, loss, lr, compute_s, finite, nbytes, norm}   + the encoded outer_grad
                                                (`steps`: what it took; a deadline job's may
                                                differ from those reserved, which are corrected)
    reject   {job, worker, reason, detail, abandon, steps}   a push refused by validation
                                                (handlers.py); θ is untouched; with `abandon` the
                                                job, the pusher's own, is given back as on a leave
    close    {round}                            sync: the outer step on what arrived (streaming:
                                                the round's end, its fragments' steps taken)
    fragment {round, fragment}                  streaming: fragment p's outer step (fragments.py;
                                                a dispatch has `round` and `keep`, a push `fragment`)
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

import statistics
from collections import deque
from typing import Any

import torch

from diloco.config import TrainConfig
from diloco.core.async_policy import (
    SpeedEstimator,
)
from diloco.core.async_rules import DelayComp
from diloco.core.codec import Encoded, tensor_bytes
from diloco.core.dylu import RoundPlan, RoundPlanner
from diloco.core.outer_side import OuterSide
from diloco.runtime import Arrival, RoundStats
from diloco.runtime.server import snapshot
from diloco.runtime.server.fragments import FragmentRounds
from diloco.runtime.server.jobs import Job
from diloco.runtime.server.plans import Plans

NORM_WINDOW = 16  # --max-update-norm-ratio compares with the median of this many accepted pushes
NORM_MIN = 4  # ... once there are at least this many


class Coordinator(Plans, FragmentRounds):
    """The server's state (see the module docstring); `side` holds θ and the outer update.
    Its decisions (`plan_dispatch`, the grace period) are in plans.py, Streaming DiLoCo's fragment
    events in fragments.py."""

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
        self._pulled: tuple[int, list[torch.Tensor]] | None = None  # (version, θ) of the last dispatch
        self.shard_steps = [0] * len(shard_sizes)
        self.dispatched = 0  # async: inner steps handed out (an abandoned job's are given back)
        self.applied = 0  # async: inner steps whose outer_grad was applied
        self.members: list[int] = []  # sync: this round's workers ([] between rounds)
        self.round_t = 0.0  # sync: when this round began
        self.inbox: dict[int, tuple[dict, Encoded]] = {}  # sync: this round's pushes, by worker
        self._setup_fragments()  # Streaming DiLoCo (fragments.py)
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
            "ranks": e.get("ranks", 1),  # a torchrun group's ranks (data parallel inside its jobs)
            "group": e.get("group", ""),  # its launch: a restart of the group takes the slot back
        }
        self.totals[w]["ranks"] = e.get("ranks", 1)

    def _on_leave(self, e, _):
        rec = self.workers.pop(e["worker"])
        tot = self.totals[e["worker"]]
        tot["present_s"] += e["t"] - rec["joined_t"]
        tot["step_s"] = rec["step_s"]
        job = self.jobs.pop(rec["job"], None) if rec["job"] is not None else None
        if job is not None and not self.sync:
            self.dispatched -= job.steps  # re-offered to the others

    def _on_regive(self, e, _):
        """An async job asked for again after its θ went out whole (the server no longer holds
        that θ, state.py `downloaded`): given back, as a departed worker's, and its worker idle."""
        self._give_back(e["job"])
        self.late.add(e["job"])  # a push of it after all is answered "late", and not logged

    def _on_begin(self, e, _):
        members = list(e["members"])
        if self.schedule is not None:  # streaming: downloads are counted per job and fragment
            self.members, self.round_t = members, e["t"]
            return
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
        keep = e.get("keep", False)  # streaming: the worker goes on from its own θ
        if not self.sync or (self.schedule is not None and not keep):
            self.side.count_pull(w)  # (sync: counted by begin)
        pulled = [] if keep else self._pulled_now()
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
            e.get("cap"),
            e.get("round"),
            keep,
        )
        self.workers[w]["job"] = job
        self.next_job = job + 1
        self.shard_steps[e["shard"]] += e["steps"]
        self.dispatched += e["steps"]

    def _pulled_now(self) -> list[torch.Tensor]:
        """θ as workers receive it now, one copy shared by the jobs of this version (a sync
        round's k jobs hold one θ, not k; Streaming DiLoCo's fragments change θ within a version,
        so it copies each time). Through a lossy download codec (bf16) it is kept as that codec's
        payload, exactly what workers receive, at its size (half of θ) and never decoded here:
        `theta_of` gives its float32 values where they are needed."""
        version = self.side.version
        if self.schedule is not None or self._pulled is None or self._pulled[0] != version:
            if self._encoded_pulls:
                pulled = self.side.download.encode(self.side.params).payload
            else:
                pulled = [p.detach().clone() for p in self.side.downloaded()]
            self._pulled = (version, pulled)
        return self._pulled[1]

    @property
    def _encoded_pulls(self) -> bool:
        return self.side.download.lossy and self.schedule is None

    def theta_of(self, pulled: list[torch.Tensor]) -> list[torch.Tensor]:
        """The float32 θ a job's worker starts from, given its `pulled`."""
        return self.side.download.decode(self.download_message(pulled)) if self._encoded_pulls else pulled

    def download_message(self, pulled: list[torch.Tensor]) -> Encoded:
        """A job's θ (`pulled`) as the download codec sends it."""
        if self._encoded_pulls:  # the payload itself (download codecs carry no meta)
            return Encoded(self.side.download.name, list(pulled), tensor_bytes(pulled))
        return self.side.download.encode(pulled)

    def stored_pulls(self, pulled: list[torch.Tensor]) -> list[torch.Tensor]:
        """A checkpoint's `pulled` as this coordinator keeps it (checkpoints before encoded
        pulls hold θ through a lossy download in float32: encoded again, the same payload)."""
        if self._encoded_pulls and pulled and pulled[0].dtype == torch.float32:
            return self.side.download.encode(pulled).payload
        return pulled

    def release_pulled(self, held: set[int]) -> None:
        """Let go of the θ copy kept for the next job of its version unless `held` needs it."""
        if self._pulled is not None and self._pulled[0] not in held:
            self._pulled = None

    def _on_push(self, e, message):
        if "fragment" in e:  # Streaming DiLoCo (fragments.py)
            return self._fragment_push(e, message)
        job = self.jobs.pop(e["job"])
        self._job_done(job, e)
        if self.sync:
            self.inbox[job.worker] = (e, message)
        else:
            self.arrived.append((e, message, job))

    def _job_done(self, job: Job, e: dict[str, Any]) -> None:
        """`job`'s (last) push `e` came: the worker's counters and measured speed."""
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
        # the training part (utilisation): a registration's first job's compute, then the time from
        # its first push to its last (its start-up, e.g. preparing the data, is not in it)
        since = rec.get("pushed_t")
        tot["train_s"] = tot.get("train_s", 0.0) + (e["compute_s"] if since is None else e["t"] - since)
        rec["pushed_t"] = e["t"]
        tot["last_steps"] = job.steps

    def _on_close(self, e, _):
        if self.schedule is not None:
            return self._close_streaming(e)
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
        pulled = self.theta_of(job.pulled) if isinstance(self.side.update, DelayComp) else None
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
            self._give_back(e["job"])

    def _give_back(self, jid: int) -> None:
        """Job `jid` is not going to be pushed: its worker is idle, its steps are re-offered."""
        job = self.jobs.pop(jid)
        self.workers[job.worker]["job"] = None
        self.workers[job.worker]["holds"] = False  # streaming: it stopped mid-job; θ is sent again
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
