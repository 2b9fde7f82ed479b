"""How the asynchronous server hands out work (docs/method.md §2): dynamic local updates
(DyLU) from measured speeds, the probe job that measures them, the grace period in which other
pushes join an update, and shard sampling by how far each shard lags behind its share.

    python -c "from diloco.core.async_policy import dylu_steps as f; print(f([0.5, 1.0, 2.0], 50))"
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

# How DyLU sizes a job: "steps", H_w from the measured speeds (the paper's form), or "time", a
# deadline every worker trains until, so jobs handed out together land together whatever a job's
# speed turns out to be (docs/async.md, DyLU, "Jobs as deadlines"); "auto": time for async (where
# speeds that wander split the grace groups of step jobs), steps for sync rounds.
DYLU_BY = ("auto", "steps", "time")


def dylu_steps(step_s: list[float], inner_steps: int, *, tolerance: float = 0.0) -> list[int]:
    """Dynamic local updates: H_w = max(1, ⌊v_w / max v · H⌋) with v = 1 / seconds per step, so
    every worker takes about as long per round as the fastest does for H steps. A worker within
    `tolerance` of the fastest (v_w / max v ≥ 1 − tolerance) takes H (sync DiLoCo's, core/dylu.py)."""
    fastest = min(step_s)
    return [
        inner_steps if fastest / s >= 1 - tolerance else max(1, math.floor(fastest / s * inner_steps))
        for s in step_s
    ]


def job_seconds(inner_steps: int, known_step_s: list[float]) -> float:
    """A time-budgeted job's length ("--dylu-by time"): H × the fastest known seconds per step,
    what the fastest worker needs for H steps."""
    return inner_steps * min(known_step_s)


# Deadline jobs end together: a job handed out while other deadline jobs are in flight ends at
# their latest deadline if that leaves it at least this fraction of a job, else whole jobs later
# (`aligned_job_s`). Without it workers whose jobs began apart (probes of unequal length, a
# worker that joins late, a push that missed its grace window) land in groups of their own for
# the rest of the run (docs/async.md, "Jobs as deadlines").
ALIGN_MIN_FRACTION = 0.5


def aligned_job_s(now: float, job_s: float, deadlines: Iterable[float]) -> float:
    """How long a deadline job handed out at `now` lasts: `job_s` if no other deadline job is in
    flight, else until the latest of their `deadlines` (plus as many `job_s` as it takes to leave
    at least ALIGN_MIN_FRACTION of a job), so its push lands with theirs: between
    ALIGN_MIN_FRACTION and 1 + ALIGN_MIN_FRACTION jobs. Exactly `job_s` when it ends with jobs
    handed out at the same moment (no rounding through the deadline)."""
    ends = list(deadlines)
    if not ends:
        return job_s
    end, least = max(ends), ALIGN_MIN_FRACTION * job_s
    if end - now < least:
        end += math.ceil((least - (end - now)) / job_s) * job_s
    return job_s if abs(end - now - job_s) <= 1e-9 * job_s else end - now


# a deadline job takes at most this many times the steps expected to fit (a worker that suddenly
# runs far faster than measured does not run away with the budget; sync rounds: core/dylu.py)
DEADLINE_CAP = 2


def expected_steps(job_s: float, step_s: float | None, inner_steps: int) -> int:
    """The steps a worker's next deadline job of `job_s` seconds is expected to reserve, knowing
    its seconds per step (None: not measured yet; its probe may be in flight already, so as much
    as the fastest worker's: H)."""
    if step_s is None:
        return inner_steps
    return max(1, math.floor(job_s / step_s * (1 + 1e-9)))


def budget_job(
    steps: int, seconds: float | None, room: int, others: int = 0
) -> tuple[int, float | None, int | None]:
    """The job the budget still allows, as (steps, seconds, cap). `room`: the budget's inner
    steps not handed out, less the headroom (cap − steps) of the deadline jobs in flight;
    `others`: the steps the other workers' next jobs are expected to reserve. A deadline job
    reserves its `steps` and may take up to DEADLINE_CAP × them, but that headroom comes only from
    room no other worker needs for its next job: near the budget's end it shrinks to nothing, so
    every worker still gets its job and the run takes exactly its budget (docs/async.md, "The
    budget's end"). A job the room cannot hold is one of exact steps, the room; steps ≤ 0:
    nothing is left to hand out now."""
    if seconds is None or steps > room:
        return min(steps, room), None, None
    return steps, seconds, steps + max(0, min((DEADLINE_CAP - 1) * steps, room - steps - others))


def another_step_fits(done: int, spent: float, seconds: float) -> bool:
    """Whether a worker that took `done` steps in `spent` seconds of a job of `seconds` starts
    another: always a first one, so every job makes progress; after it, while the time spent plus
    one more step at its mean so far fits, as a real worker can judge. (1 + 1e-9): H equal steps
    of s fit a job of H·s, whatever the rounding of their sum."""
    return done == 0 or spent + spent / done <= seconds * (1 + 1e-9)


def steps_within(seconds: float, step_s: Iterable[float]) -> int:
    """The inner steps a worker trains in a job of `seconds` (`another_step_fits`), `step_s`
    giving each step's duration in turn: what the simulator's clock says a worker would do."""
    done, spent = 0, 0.0
    for s in step_s:
        if not another_step_fits(done, spent, seconds):
            break
        done, spent = done + 1, spent + s
    return done


# A worker's first job measures its speed on its first tenth (at least one step) before DyLU
# sets how long its jobs are; those steps are training like any other.
PROBE_FRACTION = 0.1
# grace_s = "auto": a tenth of a job (H × the fastest measured seconds per step), see docs/async.md
AUTO_GRACE_FRACTION = 0.1


def probe_steps(inner_steps: int) -> int:
    """Steps of the probe that measures a new worker's speed: a tenth of H, at least one."""
    return max(1, round(inner_steps * PROBE_FRACTION))


# grace_s = "measured": the window is the spread (SCATTER_QUANTILES) of where the last
# SCATTER_WINDOW pushes landed around when the server expected them at hand-out, a fraction of a
# job; a tenth of a job until SCATTER_MIN are known (`ArrivalScatter`).
SCATTER_WINDOW, SCATTER_MIN, SCATTER_QUANTILES = 32, 4, (0.1, 0.9)


class ArrivalScatter:
    """Where pushes land around when the server expected them when it handed their jobs out
    (landing − expected, ÷ the job's expected length), pooled over workers, the last
    SCATTER_WINDOW kept. `spread()` is the range between their 10th and 90th percentiles: the
    fraction of a job a grace window must span to hold a group handed out together."""

    def __init__(self, residuals: Iterable[float] = ()):
        self.residuals = deque(residuals, maxlen=SCATTER_WINDOW)

    def add(self, landed_s: float, expected_s: float, length_s: float) -> None:
        if length_s > 0:
            self.residuals.append((landed_s - expected_s) / length_s)

    def spread(self) -> float | None:
        if len(self.residuals) < SCATTER_MIN:
            return None
        cuts = statistics.quantiles(self.residuals, n=10, method="inclusive")  # deciles
        lo, hi = (cuts[round(q * 10) - 1] for q in SCATTER_QUANTILES)
        return hi - lo


def grace_period(
    grace_s: float | str, inner_steps: int, known_step_s: list[float], spread: float | None = None
) -> float:
    """The grace period in seconds: `grace_s` as given ("inf" included); for "auto" a tenth of a
    job, H × the fastest known seconds per step (0 while no speed is known); for "measured" the
    measured `spread` of arrivals (ArrivalScatter) × a job, a tenth until it is known."""
    if grace_s not in ("auto", "measured"):
        return float(grace_s)
    fraction = spread if grace_s == "measured" and spread is not None else AUTO_GRACE_FRACTION
    return fraction * inner_steps * min(known_step_s) if known_step_s else 0.0


def grace_close(
    first_s: float, grace_s: float, in_flight: list[tuple[float, float | None]], opens_s: float | None = None
) -> float:
    """When the server closes the grace window opened by a push landing at `first_s` (or, for a
    push that landed before it was due, at `opens_s`, when it was due: a deadline job's).

    `in_flight` holds the other jobs as (when its push lands, when the server expects it; None
    if it cannot tell yet). The server waits for every push it expects inside the window (one it
    cannot predict may land any time) and never past the window's end: it closes as soon as the
    last expected push has landed, or at the window's end if one of them is late. Every push
    landed by then belongs to the group, and the group restarts at that moment."""
    end = (first_s if opens_s is None else max(first_s, opens_s)) + grace_s
    expected = [lands for lands, due in in_flight if due is None or due <= end]
    if any(lands > end for lands in expected):
        return end
    return max([first_s, *expected])


class SpeedEstimator:
    """A worker's seconds per inner step, estimated online: an exponential moving average of the
    measured time per step of each finished round (weight `alpha` on the newest), so a speed
    that changes over time is followed within a few rounds. None until the first measurement."""

    def __init__(self, alpha: float = 0.5):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.step_s: float | None = None

    def update(self, seconds: float, steps: int) -> float:
        measured = seconds / steps
        self.step_s = (
            measured if self.step_s is None else (self.alpha * measured + (1 - self.alpha) * self.step_s)
        )
        return self.step_s


def shard_probabilities(sizes: list[int], learned: list[int]) -> list[float]:
    """p_i ∝ max(|D_i|/Σ|D| − n_i/Σn, 0): shards behind their share of the examples learned so
    far are picked more; before anything is learned, in proportion to size."""
    total = sum(sizes)
    done = sum(learned)
    if done == 0:
        return [s / total for s in sizes]
    raw = [max(s / total - n / done, 0.0) for s, n in zip(sizes, learned, strict=True)]
    norm = sum(raw)
    if norm == 0:  # every shard exactly at its share
        return [s / total for s in sizes]
    return [r / norm for r in raw]
