"""The parameter server's decisions that need the clock (coordinator.py): each job's steps,
shard and deadline, the grace period, when a push is due. The server (service.py) calls them and
writes what they decide into the events, so applying the events never decides anything again.
A part of `Coordinator`.

    python -m pytest tests/unit/test_coordinator.py
"""

from __future__ import annotations

import random
from typing import Any

from diloco.core.async_policy import (
    aligned_job_s,
    budget_job,
    dylu_steps,
    expected_steps,
    grace_period,
    job_seconds,
    probe_steps,
    shard_probabilities,
)
from diloco.runtime.server.jobs import Job, most_steps


class Plans:
    """`Coordinator`'s decisions (see the module docstring)."""

    def plan_dispatch(self, w: int, now: float = 0.0) -> dict[str, Any] | None:
        """The next job of worker w, handed out at time `now` (None: the async budget is handed
        out). Sync: H steps on its own shard. Async (Algorithm 2): a first job measures the
        worker's speed on H/10 steps; later ones have H_w = max(1, ⌊fastest s/step ÷ its s/step
        × H⌋) steps (DyLU), or with jobs as deadlines end with the deadline jobs in flight
        (`aligned_job_s`), on a shard sampled by p_i ∝ max(|D_i|/Σ|D| − n_i/Σn, 0) (shard
        sampling), else its own."""
        v, job = self.cfg.async_, self.next_job
        steps, shard, lr_stride, seconds, cap, others = self.H, w, 1.0, None, None, 0
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
                job_s = job_seconds(self.H, list(measured.values()))
                seconds = aligned_job_s(now, job_s, ends)
                steps = expected_steps(seconds, measured[w], self.H)
                others = sum(expected_steps(job_s, measured.get(v), self.H) for v in self.workers if v != w)
            elif dylu:
                steps = dylu_steps(list(measured.values()), self.H)[list(measured).index(w)]
            # the budget's room: what deadline jobs in flight may still take beyond their
            # reservations is kept for them, so the run takes exactly its budget
            room = (
                self.step_budget - self.dispatched - sum(most_steps(j) - j.steps for j in self.jobs.values())
            )
            steps, seconds, cap = budget_job(steps, seconds, room, others)
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
            **({"cap": cap} if cap is not None else {}),  # logs before it: DEADLINE_CAP × steps
            **(
                {"round": self.side.rounds_done + 1, "keep": self.workers[w].get("holds", False)}
                if self.schedule is not None
                else {}
            ),
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
        possible (1 to its cap, `most_steps`; a refused push may claim anything), else the job's
        own."""
        if job.seconds is not None and claimed is not None and 1 <= claimed <= most_steps(job):
            return claimed
        return job.steps
