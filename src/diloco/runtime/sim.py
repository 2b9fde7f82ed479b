"""The simulator runtime: k workers in one process, one after another each round.

`DiLoCo` is also the library API: give it a model factory, an inner optimizer factory and one
batch iterator per worker, and call `round()` from your own loop (`DataParallel`, the baseline on
the same interface, is in data_parallel.py). Bytes are real message sizes: each round a worker
downloads the global parameters and uploads its encoded outer_grad.

    diloco train --workers 4 --inner-steps 50 --rounds 6
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import torch
import torch.nn as nn

from diloco.core.async_policy import DEADLINE_CAP, steps_within
from diloco.core.codec import Codec, Fp32Codec
from diloco.core.dylu import RoundPlan, RoundPlanner
from diloco.core.inner import LossFn, Worker, gpt_loss
from diloco.core.outer import Fragmented, Nesterov, OuterOpt
from diloco.core.outer_side import OuterSide
from diloco.core.streaming import Schedule, fragment_groups
from diloco.runtime import InProcess, RoundStats
from diloco.runtime.clock import Clock
from diloco.runtime.pool import InlinePool, ProcessPool

ModelFn = Callable[[], nn.Module]
OptFn = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def make_worker(model_fn: ModelFn, inner_opt_fn: OptFn, batches: Iterator, **kwargs: Any) -> Worker:
    """A worker with a fresh replica (its values are replaced by the global parameters at the
    start of every job) and its own inner optimizer."""
    with torch.random.fork_rng(devices=[]):  # building a replica must not move the seed's stream
        replica = model_fn()
    return Worker(
        replica, inner_opt_fn([p for p in replica.parameters() if p.requires_grad]), batches, **kwargs
    )


class DiLoCo(InProcess):
    """Synchronous DiLoCo (docs/method.md §1) over simulated workers.

    Each round every worker starts from the global parameters, runs `inner_steps` steps of its
    own optimizer on its own batches, and sends outer_grad = θ_start − θ_local through `codec`;
    the weighted average (weights default 1/k) is applied by `outer_opt` (default Nesterov,
    lr 0.7, momentum 0.9). `model` holds the global parameters; the bookkeeping of the round
    (drops, active workers, weights, version, counters) is the `side` (outer_side.py), shared
    with every other runtime.

    Workers come from `inner_opt_fn` and `batches` (one iterator per worker), or ready-made in a
    `pool` (runtime/pool.py: inline or in several processes). `clock` (runtime/clock.py) gives
    simulated durations; by default every inner step takes 1 s and messages are free. A round
    ends when the last worker's push lands. `on_nonfinite` ("stop" or "drop") says what a NaN or
    Inf loss or outer_grad does: raise `NonFinite`, or drop that outer_grad.

    `fragments` > 1 or `overlap_steps` > 0 is Streaming DiLoCo (streaming.py): fragments of the
    model sync at staggered steps, each with its own copy of `outer_opt`, and an exchange runs
    under `overlap_steps` inner steps before it is merged with weight `mix_alpha` on the local
    parameters. Every worker takes part every round then (no `active`, no `drop_prob`).
    """

    def __init__(
        self,
        model_fn: ModelFn,
        inner_opt_fn: OptFn | None = None,
        batches: Sequence[Iterator] | None = None,
        *,
        inner_steps: int,
        loss_fn: LossFn = gpt_loss,
        outer_opt: OuterOpt | None = None,
        weights: Sequence[float] | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        grad_clip: float = 0.0,
        codec: Codec | None = None,
        pool: InlinePool | ProcessPool | None = None,
        clock: Clock | None = None,
        drop_prob: float = 0.0,
        after_drop: str = "own",
        seed: int = 0,
        on_nonfinite: str = "stop",
        fragments: int = 1,
        overlap_steps: int = 0,
        mix_alpha: float = 0.5,
    ):
        model = model_fn()
        schedule = None
        if fragments > 1 or overlap_steps > 0:
            schedule = Schedule(inner_steps, fragments, overlap_steps, mix_alpha)
            outer_opt = Fragmented([copy.deepcopy(outer_opt or Nesterov()) for _ in range(fragments)])
        codec = codec or Fp32Codec()
        if pool is None:
            if inner_opt_fn is None or batches is None:
                raise ValueError("DiLoCo needs inner_opt_fn and batches (one iterator per worker), or a pool")
            pool = InlinePool(
                [
                    make_worker(
                        model_fn,
                        inner_opt_fn,
                        it,
                        loss_fn=loss_fn,
                        lr_schedule=lr_schedule,
                        grad_clip=grad_clip,
                        codec=codec,
                    )
                    for it in batches
                ]
            )
        k = len(pool)
        if k < 1 or inner_steps < 1:
            raise ValueError(f"DiLoCo needs at least one worker and inner_steps >= 1, got {k}, {inner_steps}")
        side = OuterSide(
            model,
            k,
            update=outer_opt if outer_opt is not None else Nesterov(),
            codec=codec,
            weights=weights,
            drop_prob=drop_prob,
            after_drop=after_drop,
            seed=seed,
            on_nonfinite=on_nonfinite,
        )
        self._setup(side, pool, clock or Clock([1.0] * k), inner_steps, schedule)

    @classmethod
    def from_side(
        cls,
        side: OuterSide,
        pool: InlinePool | ProcessPool,
        clock: Clock,
        *,
        inner_steps: int,
        schedule: Schedule | None = None,
        planner: RoundPlanner | None = None,
        dylu_oracle: bool = False,
    ):
        """A run built by run/assemble.py from its config: the outer side and the pool are ready (with a
        `schedule`, Streaming DiLoCo: the side's update is then `Fragmented`; with a `planner`,
        sync DiLoCo with DyLU, core/dylu.py)."""
        self = cls.__new__(cls)
        self._setup(side, pool, clock, inner_steps, schedule, planner, dylu_oracle)
        return self

    def _setup(
        self, side: OuterSide, pool, clock: Clock, inner_steps: int, schedule=None, planner=None, oracle=False
    ) -> None:
        self.side, self.pool, self.clock, self.inner_steps = side, pool, clock, inner_steps
        self.planner: RoundPlanner | None = planner  # sync DiLoCo with DyLU (core/dylu.py), or None
        self.dylu_oracle = oracle  # DyLU from the clock's true speeds
        self._sim_time_s = 0.0
        self.busy_s = [0.0] * len(pool)  # each worker's simulated seconds of inner steps (diloco plan)
        self.schedule = schedule  # Streaming DiLoCo, or None
        self._worker_s: list[float] | None = None  # streaming: each worker's simulated time
        if schedule is not None:
            if schedule.inner_steps != inner_steps or not isinstance(side.update, Fragmented):
                raise ValueError("a streaming run needs its schedule's H and a Fragmented outer optimizer")
            self.groups = fragment_groups(side.model, schedule.fragments)
            self._anchored = False  # workers know the global θ they measure outer_grads from

    # more of the outer side's state, under the names a library user reads (and SideView's)
    own_start = property(lambda self: self.side.own_start)
    weights = property(lambda self: self.side.weights)
    total_steps = property(lambda self: self.side.total_steps)
    inner_step = property(lambda self: self.side.inner_step)
    outer_opt = property(lambda self: self.side.update)

    @property
    def drop_prob(self) -> float:
        return self.side.drop_prob

    @drop_prob.setter
    def drop_prob(self, value: float) -> None:
        self.side.drop_prob = value

    @property
    def num_workers(self) -> int:
        return len(self.pool)

    @property
    def sim_time_s(self) -> float:
        return self._sim_time_s

    @property
    def workers(self) -> list[Worker]:
        """The worker objects, when they live in this process."""
        return self.pool.workers

    def round(self, *, active: int | None = None) -> RoundStats:
        """One outer step: every active worker's inner steps, then the averaged outer update.

        `active` (default all) workers take part: the first `active` ones. With `drop_prob`, each
        outer_grad is lost with that probability; its worker then continues from its own
        parameters next round (`after_drop` "own") or from the global ones ("global"), and the
        others' weights are rescaled to sum to 1.
        """
        if self.schedule is not None:
            if active is not None and active != self.num_workers:
                raise ValueError("Streaming DiLoCo runs every worker every round")
            return self._streaming_round()
        side, H, start, clock = self.side, self.inner_steps, self._sim_time_s, self.clock
        plan = self._plan(start) if self.planner is not None else None
        starts = side.begin_round(active, steps=plan.steps if plan else None)
        job, pull_bytes = side.rounds_done, side.pull_bytes
        # a worker that goes on from its own θ pulls nothing
        pulled = [start + (clock.pull_s(pull_bytes, w) if s else 0.0) for w, s in enumerate(starts)]
        for w, from_global in enumerate(starts):  # all jobs first: a process pool runs them side by side
            # the round drives the lr: a worker that joins mid-run takes the run's lr
            theta = side.downloaded() if from_global else None
            if plan is None:
                self.pool.submit(w, theta, H, lr_step=side.inner_step)
            else:
                self.pool.submit(w, theta, plan.steps[w], lr_step=plan.lr_step, lr_stride=plan.lr_strides[w])
        messages, losses, lr, end, taken = [], [], 0.0, start, []
        for w in range(len(starts)):
            result = self.pool.result(w)
            message = result.message
            counts = side.report(w, message.nbytes, result.finite)
            messages.append(message if counts else None)
            losses.append(result.mean_loss)
            lr = result.last_lr
            compute_s = clock.compute_s(w, pulled[w], result.steps, job=job)
            self.busy_s[w] += compute_s
            taken.append(result.steps)
            if plan is not None:
                self.planner.record(w, compute_s, result.steps)
            end = max(end, pulled[w] + compute_s + clock.push_s(message.nbytes, w))
        sizes = [m.nbytes for m in messages if m is not None]
        end += clock.exchange_s(sizes, side.param_bytes, side.codec.summable)  # a ring's all-reduce
        advance = H if plan is None else self.planner.spend(sum(taken))
        side.end_round(side.reduce(messages), advance)
        self._sim_time_s = end
        stats = self._stats(losses, lr)
        stats.steps = taken if plan is not None else None
        return stats

    def _plan(self, start: float) -> RoundPlan:
        """The round's H_w (sync DiLoCo with DyLU): from the measured speeds (the oracle: the
        profile's true ones); with deadlines, the steps each worker's clock fits in them (at most
        DEADLINE_CAP × those expected, as a real worker; the lr strides stay the expected ones,
        which is all a real worker knows when it starts)."""
        k, clock, planner = self.num_workers, self.clock, self.planner
        oracle = [clock.true_step_s(w, start) for w in range(k)] if self.dylu_oracle else None
        plan = planner.plan(oracle)
        if plan.seconds is not None:
            job, pull_bytes = self.side.rounds_done, self.side.pull_bytes
            plan.steps = [
                steps_within(
                    plan.seconds,
                    islice(
                        clock.step_times(w, start + clock.pull_s(pull_bytes, w), job=job),
                        DEADLINE_CAP * n,
                    ),
                )
                for w, n in enumerate(plan.steps)
            ]
        return plan

    def _streaming_round(self) -> RoundStats:
        """One round of Streaming DiLoCo: the schedule's segments for every worker; a fragment's
        outer step is taken as soon as every worker sent it (its result is only merged later, so
        when it is computed changes nothing). Each worker has its own clock: it waits at a merge
        for the exchange to land (max of the pushes, plus the download), which overlapped inner
        steps hide."""
        side, clock, k, H = self.side, self.clock, self.num_workers, self.inner_steps
        t = self._worker_s if self._worker_s is not None else [self._sim_time_s] * k
        job = side.rounds_done
        totals, lr = [0.0] * k, 0.0
        # fragment -> (θ_frag, when every push was in, its download's bytes)
        landed: dict[int, tuple[list[torch.Tensor], float, int]] = {}
        for n, seg in enumerate(self.schedule.segments()):
            for w in range(k):
                kwargs: dict[str, Any] = {}
                if n == 0 and not self._anchored:
                    kwargs["anchor"] = side.downloaded()
                    if side.rounds_done == 0:  # the first pull; after a resume they hold their own θ
                        kwargs["start"] = side.pull(w)
                        t[w] += clock.pull_s(side.pull_bytes, w)
                if seg.merge is not None:
                    tensors, pushed, nbytes = landed[seg.merge]
                    kwargs["merge"] = (self.groups[seg.merge], tensors, self.schedule.alpha)
                    t[w] = max(t[w], pushed + clock.pull_s(nbytes, w))  # every push in, then its download
                if seg.send is not None:
                    kwargs["send"] = (seg.send, self.groups[seg.send])
                self.pool.submit_segment(w, seg.steps, **kwargs)
            self._anchored = True
            messages, arrivals = [], []
            for w in range(k):
                result = self.pool.result(w)
                totals[w] += result.mean_loss * seg.steps
                lr = result.last_lr if seg.steps else lr
                compute_s = clock.compute_s(w, t[w], seg.steps, job=job)
                t[w] += compute_s
                self.busy_s[w] += compute_s
                if seg.send is not None:
                    side.sent_fragment(w, result.message.nbytes, result.finite)
                    messages.append(result.message)
                    arrivals.append(t[w] + clock.push_s(result.message.nbytes, w))
                else:
                    side.stop_if_nonfinite(w, result.finite)
            if seg.send is not None:
                group = self.groups[seg.send]
                fragment = side.end_fragment(seg.send, group, side.reduce_fragment(messages, group))
                nbytes = side.download.message_bytes(fragment)
                sizes, summable = [m.nbytes for m in messages], side.codec.summable
                exchanged = max(arrivals) + clock.exchange_s(sizes, side.float_bytes(group), summable)
                landed[seg.send] = (fragment, exchanged, nbytes)
        side.end_streaming_round(H)
        self._worker_s = t
        self._sim_time_s = max(t)
        return self._stats([x / H for x in totals], lr)

    def _stats(self, losses: list[float], lr: float) -> RoundStats:
        return RoundStats(
            self.version, self.inner_step, losses, lr, list(self.bytes_sent), list(self.bytes_received)
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "outer": self.side.state_dict(),
            "workers": self.pool.state_dict(),
            "runtime": {
                "sim": {"sim_time_s": self._sim_time_s, "worker_s": self._worker_s, "busy_s": self.busy_s}
            },
            **({"dylu": self.planner.state_dict()} if self.planner is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.side.load_state_dict(state["outer"])
        self.pool.load_state_dict(state["workers"])
        if self.planner is not None and "dylu" in state:
            self.planner.load_state_dict(state["dylu"])
        # A run that comes from a real runtime has no simulated time yet: it starts at 0.
        mine = state.get("runtime", {}).get("sim", {})
        self._sim_time_s = float(mine.get("sim_time_s", 0.0))
        if len(busy := mine.get("busy_s") or []) == self.num_workers:
            self.busy_s = [float(x) for x in busy]
        if self.schedule is not None:
            self._anchored = False  # they hold their own θ; the global one is theirs to measure from
            worker_s = mine.get("worker_s")
            self._worker_s = (
                [float(x) for x in worker_s] if worker_s and len(worker_s) == self.num_workers else None
            )

    def close(self, *, clean: bool = True) -> None:
        self.pool.close()
