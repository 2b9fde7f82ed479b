"""The simulator's virtual clock: how long workers take per inner step and per message.

A worker's time per inner step is its base speed profile (`--speeds`, or a `--heterogeneity`
level), times a per-round jitter factor (`--speed-jitter`), times any scheduled slowdown active at
that moment (`--slowdown W:FACTOR@START-END`). A pull or push of B bytes over worker w's link
costs B ÷ bandwidth_w + latency_w (one link for all, or one per worker: `diloco plan
--link-mbps`). The workers meet as a `star` (a parameter server: each pulls θ and pushes its
message over its own link, the simulator's runtime) or, for `diloco plan --runtime collective`,
a `ring` (torchrun: nothing is pulled; once every worker's steps are done the outer_grads are
all-reduced, 2(k − 1)/k × their float32 bytes, or their encoded messages all-gathered, k − 1
of the largest, over the slowest link, with a latency per ring step). Nothing here touches
tensors; results depend only on the seed.

Real runtimes emulate other devices with `slowed`: under torchrun `--speeds` pads each inner
step of a worker to at least its seconds and `--slowdown` multiplies them; `diloco worker
--slowdown F` pads each step to F × its measured time.

    diloco train --method async --heterogeneity very --bandwidth-mbps 100 --latency-ms 20
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from diloco.config.parsers import Slowdown
from diloco.config.sections import HETEROGENEITY

TOPOLOGIES = ("star", "ring")


def profile(level: str, k: int) -> list[float]:
    """Seconds per inner step of each of k workers for a named heterogeneity level: worker i's
    is spread^(i / (k − 1)) seconds, geometric from 1 s (worker 0) to the level's spread."""
    spread = HETEROGENEITY[level]
    return [spread ** (i / (k - 1)) if k > 1 else 1.0 for i in range(k)]


class Clock:
    """Simulated durations of compute and communication, deterministic for a seed."""

    def __init__(
        self,
        step_s: list[float],
        *,
        jitter: float = 0.0,
        slowdowns: tuple[Slowdown, ...] = (),
        bandwidth_mbps: float | Sequence[float] = 0.0,
        latency_ms: float | Sequence[float] = 0.0,
        seed: int = 0,
        topology: str = "star",
    ):
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
        self.topology = topology
        self.step_s = list(step_s)
        self.jitter = jitter
        self.slowdowns = slowdowns
        self.bandwidth_mbps = bandwidth_mbps  # 0 means unlimited; or one per worker
        self.latency_ms = latency_ms  # or one per worker
        self.seed = seed

    def transfer_s(self, nbytes: int, worker: int | None = None) -> float:
        """Time for one message of `nbytes` to cross worker `worker`'s link (None: the slowest
        link, which is what a collective over every worker waits for)."""
        if worker is None:
            return max(self.transfer_s(nbytes, w) for w in range(len(self.step_s)))
        mbps, ms = self.bandwidth_mbps, self.latency_ms
        mbps = mbps if isinstance(mbps, (int, float)) else mbps[worker]  # one for all, or one each
        ms = ms if isinstance(ms, (int, float)) else ms[worker]
        return (nbytes * 8 / (mbps * 1e6) if mbps > 0 else 0.0) + ms / 1e3

    def pull_s(self, nbytes: int, worker: int) -> float:
        """Worker w's download of θ (`nbytes`): over its link in a star; none in a ring (every
        rank applies the outer step itself)."""
        return self.transfer_s(nbytes, worker) if self.topology == "star" else 0.0

    def push_s(self, nbytes: int, worker: int) -> float:
        """Worker w's upload of its message: over its link in a star; part of `exchange_s` in a ring."""
        return self.transfer_s(nbytes, worker) if self.topology == "star" else 0.0

    def exchange_s(self, messages: list[int], float_bytes: int, summable: bool) -> float:
        """What a ring adds once every worker's steps are done (0 in a star): an all-reduce of
        the float32 contributions (`float_bytes` each; `summable` codecs) or an all-gather of the
        encoded `messages`, over the slowest link."""
        if self.topology == "star" or len(messages) < 2:
            return 0.0
        k = len(messages)
        crossing, hops = (
            (2 * (k - 1) / k * float_bytes, 2 * (k - 1)) if summable else ((k - 1) * max(messages), k - 1)
        )
        mbps = self.bandwidth_mbps
        slowest = mbps if isinstance(mbps, (int, float)) else min((m for m in mbps if m > 0), default=0.0)
        ms = self.latency_ms if isinstance(self.latency_ms, (int, float)) else max(self.latency_ms)
        return (crossing * 8 / (slowest * 1e6) if slowest > 0 else 0.0) + hops * ms / 1e3

    def _jitter(self, worker: int, job: int) -> float:
        if self.jitter == 0:
            return 1.0
        # One factor per (worker, job), from its own seeded stream: independent of event order.
        u = random.Random(f"{self.seed}/{worker}/{job}").uniform(-1.0, 1.0)
        return 1.0 + self.jitter * u

    def slowdown(self, worker: int, t: float) -> float:
        """The product of `worker`'s slowdown factors active at time t (1: none)."""
        factor = 1.0
        for s in self.slowdowns:
            if s.worker == worker and s.start_s <= t < s.end_s:
                factor *= s.factor
        return factor

    def compute_s(self, worker: int, start_s: float, steps: int, *, job: int) -> float:
        """Simulated time for `steps` inner steps of `worker` starting at `start_s`; `job` numbers
        the worker's rounds (for jitter). Slowdowns apply step by step, at each step's start."""
        base = self.step_s[worker] * self._jitter(worker, job)
        if not self.slowdowns:
            return base * steps
        t = start_s
        for _ in range(steps):
            t += base * self.slowdown(worker, t)
        return t - start_s

    def step_times(self, worker: int, start_s: float, *, job: int) -> Iterator[float]:
        """The durations of `worker`'s inner steps from `start_s` on, one by one (endless), as
        `compute_s` adds them up."""
        base, t = self.step_s[worker] * self._jitter(worker, job), start_s
        while True:
            step = base * self.slowdown(worker, t)
            yield step
            t += step

    def true_step_s(self, worker: int, t: float) -> float:
        """The profile's time per step at time t, without jitter (what an oracle would know)."""
        return self.step_s[worker] * self.slowdown(worker, t)


def slowed(
    worker: Any, emulated_s: Callable[[float], float], pause: Callable[[float], Any] = time.sleep
) -> None:
    """Emulate another machine in a real process: each of `worker`'s inner steps, measured at
    t seconds, is padded to `emulated_s(t)` seconds (FACTOR × t for a slower one), waiting with
    `pause(seconds)` (one that returns early lets a stopped run end at once)."""
    step = worker.train_step

    def train_step(lr_step: int | None = None):
        t0 = time.perf_counter()
        out = step(lr_step)
        took = time.perf_counter() - t0
        if (extra := emulated_s(took) - took) > 0:
            pause(extra)
        return out

    worker.train_step = train_step
