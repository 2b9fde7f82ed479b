"""Asynchronous Local-SGD in the simulator (docs/method.md §2), on the virtual clock.

A worker pulls θ (at `version` v), runs its local steps, and pushes outer_grad = θ_pulled −
θ_local; the server applies it at once to the current θ with an `AsyncRule`, and the worker
pulls again. Events are processed in simulated-time order (ties by worker index), so a run is
deterministic for a seed whatever the number of processes computing the workers.

The server decides each job as Algorithm 2 does: its steps (DyLU: H_w from measured or true
speeds, or a deadline), its shard (sampled, or the worker's own), and with a grace period holds
back workers that finish within it so they restart from the same θ (`grace_close`). A first job
measures its worker's speed on its first steps (the probe, counted as training).

    diloco train --method async --heterogeneity very            # DN + DyLU with deadline jobs
    diloco train --method async --no-dylu --no-shard-sampling --grace-s 0   # the bare rule
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from diloco.config import TrainConfig
from diloco.core.async_policy import (
    ArrivalScatter,
    SpeedEstimator,
    aligned_job_s,
    budget_job,
    dylu_steps,
    expected_steps,
    grace_close,
    grace_period,
    job_seconds,
    probe_steps,
    shard_probabilities,
    steps_within,
)
from diloco.core.async_rules import AsyncRule, DelayComp
from diloco.core.codec import Codec
from diloco.core.inner import InnerResult
from diloco.core.outer_side import OuterSide
from diloco.runtime import Arrival, InProcess
from diloco.runtime.async_state import AsyncCheckpoint
from diloco.runtime.clock import Clock
from diloco.runtime.pool import InlinePool, ProcessPool
from diloco.runtime.sim import ModelFn


class AsyncDiLoCo(AsyncCheckpoint, InProcess):
    """The asynchronous server and its workers, driven by the virtual clock.

    `total_steps` is the compute budget (`step_budget`): inner steps over all workers (k × rounds
    × H for equal compute with sync). `step()` processes the next push (and, with a grace period, the pushes
    synced with it) and hands out new jobs; `run(on_arrival)` steps until `done`. The global
    parameters, the rule and the counters are the `side` (outer_side.py).

    Between steps the whole state can be saved: `state_dict()` first collects the results of
    the jobs in flight (each worker's computation depends only on its own state and the
    parameters it pulled, so computing a job early changes nothing) and saves them with the
    event queue, the clock, the speed estimates, the shard step counts and the random state.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        pool: InlinePool | ProcessPool,
        *,
        rule: AsyncRule,
        clock: Clock,
        inner_steps: int,
        total_steps: int,
        codec: Codec | None = None,
        dylu: bool = True,
        dylu_oracle: bool = False,
        dylu_alpha: float = 0.5,
        dylu_by: str = "time",
        grace_s: float | str = "auto",
        shard_sizes: list[int] | None = None,
        seed: int = 0,
        on_nonfinite: str = "stop",
    ):
        side = OuterSide(
            model_fn(), len(pool), update=rule, codec=codec, seed=seed, on_nonfinite=on_nonfinite
        )
        dylu_how = (dylu, dylu_oracle, dylu_alpha, dylu_by)
        self._setup(side, pool, clock, inner_steps, total_steps, dylu_how, grace_s, shard_sizes)

    @classmethod
    def from_config(
        cls, cfg: TrainConfig, side: OuterSide, pool, clock: Clock, *, shard_sizes: list[int]
    ) -> AsyncDiLoCo:
        """A run built by run/assemble.py: the server's settings come from `cfg.async_` and
        `cfg.dylu`."""
        v, d, self = cfg.async_, cfg.dylu, cls.__new__(cls)
        total = cfg.num_workers * cfg.total_inner_steps
        sizes = shard_sizes if v.shard_sampling else None
        dylu_how = (d.on(cfg.method), d.oracle, d.alpha, d.by_for(cfg.method))
        self._setup(side, pool, clock, cfg.inner_steps, total, dylu_how, v.grace_s, sizes)
        return self

    def _setup(self, side, pool, clock, inner_steps, total_steps, dylu_how, grace_s, shard_sizes) -> None:
        k = len(pool)
        dylu, dylu_oracle, dylu_alpha, dylu_by = dylu_how
        self.side, self.pool, self.rule, self.clock = side, pool, side.update, clock
        self.inner_steps, self.step_budget = inner_steps, total_steps
        self.dylu, self.dylu_oracle, self.grace_s = dylu or dylu_oracle, dylu_oracle, grace_s
        self.by_time = self.dylu and dylu_by == "time"  # jobs are deadlines (job_seconds)
        self.estimators = [SpeedEstimator(dylu_alpha) for _ in range(k)]
        self.scatter = ArrivalScatter()  # for --grace-s measured
        self._push_bytes = side.codec.message_bytes(side.params)  # one encoded outer_grad
        self._probes: dict[int, tuple[float, float]] = {}  # worker -> (probe ends at, s per step)
        # a first job that is its probe alone, pushed like any job, as on the server (which cannot
        # resize a running job): what `diloco plan` simulates for a server's run
        self.probe_job = False
        self.shard_sizes = shard_sizes  # None: every worker keeps its own shard
        self.shard_steps = [0] * (len(shard_sizes) if shard_sizes else k)
        self.rng = random.Random(side.seed)
        # simulated time; inner steps handed out (a deadline job's: those it reserves, until it
        # lands), and those whose outer_grad has arrived
        self._sim_time_s, self.dispatched, self.applied = 0.0, 0, 0
        self.busy_s = [0.0] * k  # each worker's simulated seconds of inner steps whose push arrived
        self._jobs = [0] * k  # jobs per worker, numbering jitter draws
        self._heap: list[tuple[float, int, int]] = []
        self._inflight: dict[int, dict] = {}
        self._ready: dict[int, InnerResult] = {}  # results collected early (for a checkpoint)
        self._waiting: list[int] = []  # workers the budget's room left idle until a deadline job lands
        self._started = False
        # the grace group being applied [(lands, worker)], its workers not applied yet, when they restart
        self._group, self._pending, self._restart = [], [], 0.0

    @property
    def num_workers(self) -> int:
        return len(self.pool)

    @property
    def sim_time_s(self) -> float:
        return self._sim_time_s

    @property
    def done(self) -> bool:
        return self._started and not self._heap and not self._group

    @property
    def probe_steps(self) -> int:
        return probe_steps(self.inner_steps)

    def known_step_s(self, t: float) -> list[float | None]:
        """What the server knows at time t of each worker's seconds per step: its estimate after
        a finished job, else its probe's measurement once the probe has ended, else None."""
        known: list[float | None] = []
        for w, e in enumerate(self.estimators):
            probe = self._probes.get(w)
            known.append(e.step_s if e.step_s is not None else probe[1] if probe and probe[0] <= t else None)
        return known

    def grace_at(self, t: float) -> float:
        """The grace period at time t: `grace_s`, or for "auto" a tenth of a job, H × the fastest
        known seconds per step (0 while no speed is known)."""
        known = [s for s in self.known_step_s(t) if s is not None]
        return grace_period(self.grace_s, self.inner_steps, known, self.scatter.spread())

    def _steps_for(self, w: int, t: float, start_s: float) -> tuple[int, float | None, int, int]:
        """The job of worker w handed out at t whose steps start at `start_s`, before the budget
        has its say: its steps (a deadline job's: those the server expects to fit, at its
        estimate of w's speed), its length in seconds when jobs are deadlines (else None), the
        fewest steps it takes (a first job's probe; its length is set when the probe ends), and
        the steps the other workers' next jobs are expected to reserve (`budget_job`)."""
        if not self.dylu:
            return self.inner_steps, None, 1, 0
        first = self.estimators[w].step_s is None and not self.dylu_oracle
        if first and self.probe_job:  # the server's probe: a job of its own
            return self.probe_steps, None, self.probe_steps, 0
        if self.dylu_oracle:
            speeds = [self.clock.true_step_s(i, t) for i in range(self.num_workers)]
        else:
            known = self.known_step_s(self._probes[w][0] if first else t)
            # a worker not measured yet is no faster than w: every faster one has ended its probe
            speeds = [s if s is not None else known[w] for s in known]
        least = self.probe_steps if first else 1
        if self.by_time:  # a deadline: the server reserves the steps it expects to fit
            job_s = seconds = job_seconds(self.inner_steps, speeds)
            if not first:  # it ends with the deadline jobs in flight (first jobs all start at 0)
                seconds = aligned_job_s(start_s, seconds, self._deadlines_set(t))
            known = speeds if self.dylu_oracle else self.known_step_s(t)
            others = sum(
                expected_steps(job_s, known[v], self.inner_steps) for v in range(len(known)) if v != w
            )
            return max(least, expected_steps(seconds, speeds[w], self.inner_steps)), seconds, least, others
        return max(least, dylu_steps(speeds, self.inner_steps)[w]), None, least, 0

    def _room(self) -> int:
        """The budget's room as the server counts it (`budget_job`): inner steps not handed out,
        less what the deadline jobs in flight may still take beyond their reservations."""
        headroom = sum(j["cap"] - j["reserved"] for j in self._inflight.values() if j["cap"])
        return self.step_budget - self.dispatched - headroom

    def _deadlines_set(self, t: float) -> list[float]:
        """The deadlines in flight that the server has set by time t (a first job's: at its probe's end)."""
        set_by = {
            v: self._probes[v][0] if self._jobs[v] == 1 and v in self._probes else 0.0 for v in self._inflight
        }
        return [
            j["started_s"] + j["seconds"]
            for v, j in self._inflight.items()
            if j["seconds"] and not j.get("landed") and set_by[v] <= t
        ]

    def _probe(self, w: int, t: float) -> None:
        """Worker w's first job starts at t: its first steps measure its speed."""
        pulled_at = t + self.clock.transfer_s(self.side.pull_bytes, w)
        seconds = self.clock.compute_s(w, pulled_at, self.probe_steps, job=self._jobs[w])
        self._probes[w] = (pulled_at + seconds, seconds / self.probe_steps)

    def _pick_shard(self, w: int) -> int | None:
        if self.shard_sizes is None:
            return None
        probs = shard_probabilities(self.shard_sizes, self.shard_steps)
        return self.rng.choices(range(len(probs)), weights=probs)[0]

    def _dispatch(self, w: int, t: float) -> None:
        pulled_at = t + self.clock.transfer_s(self.side.pull_bytes, w)
        reserved, seconds, least, others = self._steps_for(w, t, pulled_at)
        reserved, seconds, cap = budget_job(reserved, seconds, self._room(), others)
        if reserved <= 0:  # a deadline job in flight may leave room when it lands (`_landed`)
            if w not in self._waiting and any(j["cap"] for j in self._inflight.values()):
                self._waiting.append(w)
            return
        steps = reserved  # a deadline job: the worker trains until the deadline, within its cap
        if seconds is not None:
            fits = steps_within(seconds, self.clock.step_times(w, pulled_at, job=self._jobs[w]))
            steps = min(cap, max(least, fits))
        shard = self._pick_shard(w)
        key = w if shard is None else shard
        shard_step = self.shard_steps[key]
        self.shard_steps[key] += reserved  # as the server counts them until the push lands
        self.pool.submit(w, self.side.pull(w), steps, lr_step=shard_step, shard=shard)
        compute_s = self.clock.compute_s(w, pulled_at, steps, job=self._jobs[w])
        arrival = pulled_at + compute_s + self.clock.transfer_s(self._push_bytes, w)
        step_s = self.known_step_s(t)[w]  # the job's length as expected now (ArrivalScatter)
        length = seconds if seconds is not None else None if step_s is None else reserved * step_s
        expected = None if length is None else [arrival - compute_s + length, length]
        self._jobs[w] += 1
        self.dispatched += reserved
        pulled = [p.detach().clone() for p in self.params] if isinstance(self.rule, DelayComp) else None
        self._inflight[w] = {
            "steps": steps,
            "started_s": pulled_at,
            "compute_s": compute_s,
            "version": self.version,
            "pulled": pulled,
            "shard": key,
            "seconds": seconds,
            "expected": expected,  # [when it should land, how long it should take]
            "reserved": reserved,  # the steps the budget counts until it lands
            "cap": cap,  # a deadline job's most steps (None: an exact job)
        }
        heapq.heappush(self._heap, (arrival, w, w))

    def _landed(self, w: int, t: float) -> None:
        """Worker w's push lands at t: as on the server, the budget counts the steps it took (a
        deadline job's are known now), its headroom is let go, its deadline no longer counts and
        its speed is measured; then workers waiting for room get their jobs."""
        job = self._inflight[w]
        job["landed"], job["estimate"] = True, self.estimators[w].update(job["compute_s"], job["steps"])
        if job["cap"]:
            self.dispatched += job["steps"] - job["reserved"]
            self.shard_steps[job["shard"]] += job["steps"] - job["reserved"]
            job["reserved"], job["cap"] = job["steps"], None
        waiting, self._waiting = self._waiting, []
        for v in waiting:
            self._dispatch(v, t)

    def _arrive(self, w: int, t: float, group_end: bool) -> Arrival:
        job = self._inflight.pop(w)
        result = self._ready.pop(w) if w in self._ready else self.pool.result(w)
        message = result.message
        staleness = self.version - job["version"]
        flags = {"finite": result.finite, "pulled": job["pulled"], "group_end": group_end}
        changed = self.side.apply_async(w, message, steps=job["steps"], staleness=staleness, **flags)
        self.applied += job["steps"]
        self.busy_s[w] += job["compute_s"]
        self._sim_time_s = t
        estimate = job["estimate"]  # measured when it landed (`_landed`)
        if job.get("expected"):
            self.scatter.add(t, *job["expected"])
        return Arrival(
            w, job["steps"], staleness, changed, result.mean_loss, result.last_lr, job["shard"], estimate, t
        )

    def _due(self, w: int, step_s: float | None) -> float | None:
        """When the server expects worker w's push, knowing its seconds per step (None: unknown);
        a deadline job's is its deadline's, whatever the speed."""
        job = self._inflight[w]
        if job["seconds"] is not None:
            return job["started_s"] + job["seconds"] + self.clock.transfer_s(self._push_bytes, w)
        if step_s is None:
            return None
        return job["started_s"] + job["steps"] * step_s + self.clock.transfer_s(self._push_bytes, w)

    @property
    def at_boundary(self) -> bool:
        """No grace group is half-applied: the state can be saved (see `state_dict`)."""
        return not self._group

    def step(self) -> Arrival | None:
        """Apply the next push in time order and return it (None when the budget is spent).

        With a grace period, the pushes landing before the server closes the window (see
        `grace_close`) form a group: each is applied in turn by the following calls, and once the
        last one is, the group's workers restart together from the same θ when the window
        closed. The first call probes every worker's speed and hands out the first jobs. At the
        end, what a rule still holds back (a buffer of fewer than N) is applied, not lost."""
        if not self._started:
            self._started = True
            for w in range(self.num_workers):  # every first job's probe, before any job's length
                if not self.probe_job:
                    self._probe(w, 0.0)
            for w in range(self.num_workers):
                self._dispatch(w, 0.0)
        if not self._group:
            if not self._heap:
                return None
            t, _, w = heapq.heappop(self._heap)
            self._group, close = [(t, w)], t
            grace = self.grace_at(t)  # without one, each push is on its own, ties too
            if grace > 0:
                known = self.known_step_s(t)
                # a deadline job may land before its deadline: the window opens when it was due
                opens = self._due(w, None) if self._inflight[w]["seconds"] is not None else None
                in_flight = [(lands, self._due(j, known[j])) for lands, _, j in self._heap]
                close = grace_close(t, grace, in_flight, opens)
            self._landed(w, t)  # each push as it lands: a job it frees may land in the window too
            while grace > 0 and self._heap and self._heap[0][0] <= close:
                ta, _, wa = heapq.heappop(self._heap)
                self._landed(wa, ta)
                self._group.append((ta, wa))
            self._restart = close
            self._pending = [w for _, w in self._group]
        ta, wa = self._group[len(self._group) - len(self._pending)]
        w = self._pending.pop(0)
        arrival = self._arrive(w, ta, group_end=not self._pending)
        if not self._pending:
            for _, w in self._group:
                self._dispatch(w, self._restart)
            self._group = []
            if not self._heap:
                self.side.flush()
        return arrival

    def run(self, on_arrival: Callable[[Arrival], None] = lambda a: None) -> None:
        """Process every push in simulated-time order until the compute budget is spent."""
        while (arrival := self.step()) is not None:
            on_arrival(arrival)

    def close(self, *, clean: bool = True) -> None:
        self.pool.close()
