"""`diloco plan`: a run's wall time, compute utilisation and bytes, predicted before it runs.

The planner runs the simulator itself (runtime/sim.py, async_sim.py, data_parallel.py: one
definition of time, `Clock`) on a stand-in of the model: one tiny tensor per fragment (one in all
without Streaming DiLoCo), whose messages report the sizes the real model's would have, computed
from its shapes on the meta device (`Codec.message_bytes`; nothing is allocated, so a 10B model
costs what nano does). Its workers train no step (`PlanPool`): a job takes the time the clock says
and sends a message of the real size. Every event the simulator would process is processed: the
rounds, the drops, DyLU's plans, the grace windows and the staleness of async updates.

A run of more than `rounds_simulated` rounds is simulated for that many and scaled up (a round of
sync DiLoCo takes the same time every round without jitter; with jitter, the mean over the window).

    diloco plan --model 10b --workers 64 --inner-steps 100 --step-s 0.8 --link-mbps 1000 --json
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from diloco.config import AsyncConfig, DyluConfig, TrainConfig
from diloco.core.codec import Codec, Encoded, Fp32Codec
from diloco.core.inner import InnerResult
from diloco.core.outer_side import OuterSide
from diloco.core.streaming import fragment_groups
from diloco.errors import UserError
from diloco.model.init import build_model
from diloco.run.assemble import (
    async_rule,
    build_clock,
    download_codec,
    outer_opt,
    simulator,
    upload_codec,
)
from diloco.runtime import Arrival
from diloco.runtime.async_sim import AsyncDiLoCo
from diloco.runtime.data_parallel import dp_steps_s
from diloco.runtime.sim import DiLoCo

TARGET = 0.95  # the compute utilisation `bandwidth_for_95pct_mbps` is for (relative to an unlimited link)
SEARCH_ROUNDS = 5  # rounds simulated per probe of the bandwidth search


class _Unit(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))


class StandIn(nn.Module):
    """The model as the planner sees it: `blocks.i.w` of i + 1 values stands for fragment i (so
    `fragment_groups` finds the same P fragments, and a tensor's size says which one it is)."""

    def __init__(self, units: int):
        super().__init__()
        self.blocks = nn.ModuleList(_Unit(i + 1) for i in range(units))


class Sized(Codec):
    """`codec` on the stand-in's tensors, its messages sized as the real model's: a stand-in
    tensor of i + 1 values counts `sizes[i + 1]` bytes."""

    def __init__(self, codec: Codec, sizes: dict[int, int]):
        super().__init__()
        self.inner, self.sizes = codec, sizes
        self.name, self.summable, self.lossy = codec.name, codec.summable, codec.lossy

    def encode(self, tensors: list[torch.Tensor], state: dict[str, Any] | None = None) -> Encoded:
        message = self.inner.encode(tensors)
        message.nbytes = self.message_bytes(tensors)
        message.meta = {**message.meta, "numels": [t.numel() for t in tensors]}
        return message

    def decode_each(self, message: Encoded):
        """Zeros of the stand-in's sizes (what a message of zeros decodes to, without decoding:
        a round of 64 workers decodes 64 messages)."""
        return (torch.zeros(n) for n in message.meta["numels"])

    def message_bytes(self, tensors: list[torch.Tensor]) -> int:
        return sum(self.sizes[t.numel()] for t in tensors)


class PlanSide(OuterSide):
    """The outer side with its bookkeeping (rounds, drops, weights, versions, bytes) and no
    arithmetic worth doing: every message is zeros, so a sum of k of them is zeros, made without
    decoding k messages (a round of 64 workers and 16 fragments would decode 1,024)."""

    def __init__(self, *args, float_sizes: dict[int, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.float_sizes = float_sizes  # a stand-in tensor's numel -> its fragment's float32 bytes

    def float_bytes(self, indices) -> int:
        return sum(self.float_sizes[self.params[i].numel()] for i in indices)

    def reduce(self, messages):
        return [torch.zeros_like(p) for p in self.params]

    def reduce_fragment(self, messages, group):
        return None if all(m is None for m in messages) else [torch.zeros_like(self.params[i]) for i in group]


class PlanPool:
    """k workers that train no step: a job's result is its steps and an all-zero message of the
    stand-in (its size the real one's), made once per fragment and reused."""

    def __init__(self, k: int, codec: Codec, params: list[torch.Tensor]):
        self.workers: list[Any] = [None] * k
        self.codec, self.params = codec, params
        self._jobs: dict[int, tuple[int, list[int] | None]] = {}
        self._messages: dict[tuple[int, ...], Encoded] = {}

    def __len__(self) -> int:
        return len(self.workers)

    def submit(self, w: int, start: Any, steps: int, **job: Any) -> None:
        self._jobs[w] = (steps, None)

    def submit_segment(self, w: int, steps: int, send: tuple[int, list[int]] | None = None, **_: Any) -> None:
        self._jobs[w] = (steps, None if send is None else send[1])

    def result(self, w: int) -> InnerResult:
        steps, group = self._jobs.pop(w)
        key = tuple(range(len(self.params)) if group is None else group)
        if key not in self._messages:
            self._messages[key] = self.codec.encode([torch.zeros_like(self.params[i]) for i in key])
        return InnerResult([], steps, 0.0, 0.0, True, self._messages[key])

    def state_dict(self) -> list:
        return []

    def close(self) -> None:
        pass


class Shapes:
    """The real model's trainable parameters on the meta device (nothing allocated), and its
    fragments' message sizes per codec; made once per model, so a sweep reuses them."""

    def __init__(self):
        self._models: dict[Any, tuple[nn.Module, list[torch.Tensor]]] = {}

    def _model(self, cfg: TrainConfig) -> tuple[nn.Module, list[torch.Tensor]]:
        if cfg.model not in self._models:
            with torch.device("meta"), _no_init():
                model = build_model(cfg)
            self._models[cfg.model] = (model, [p for p in model.parameters() if p.requires_grad])
        return self._models[cfg.model]

    def sizes(self, cfg: TrainConfig, codec: Codec, units: int) -> dict[int, int]:
        """{i + 1: bytes of fragment i's message through `codec`} for `units` fragments."""
        model, params = self._model(cfg)
        groups = _fragments(model, units) if units > 1 else [list(range(len(params)))]
        return {i + 1: codec.message_bytes([params[j] for j in g]) for i, g in enumerate(groups)}

    def param_bytes(self, cfg: TrainConfig) -> int:
        return sum(p.numel() * p.element_size() for p in self._model(cfg)[1])


@contextlib.contextmanager
def _no_init():
    """torch.nn.init's functions as no-ops: a model built on the meta device has no values to
    initialise (and initialising meta tensors costs seconds per large model)."""
    names = [n for n in ("normal_", "zeros_", "ones_", "uniform_", "kaiming_uniform_", "trunc_normal_")]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **kw: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def _fragments(model: nn.Module, units: int) -> list[list[int]]:
    try:
        return fragment_groups(model, units)
    except ValueError as e:
        raise UserError(f"{e}: give --fragments at most the model's number of blocks.") from None


def simulate(
    cfg: TrainConfig, shapes: Shapes, links: list[float] | None = None, runtime: str = "server"
) -> dict[str, Any]:
    """One simulated run of `cfg` (its rounds as given: no scaling): wall time, each worker's
    seconds of compute and bytes, and for async the staleness of each update. `links`: each
    worker's Mbit/s (default the config's --bandwidth-mbps for all); `runtime`: "server" (a star;
    async's first job is its probe alone, as the server's is), "sim" (a star; the simulator folds
    the probe into the first job) or "collective" (torchrun's ring; runtime/clock.py)."""
    k = cfg.num_workers
    clock = build_clock(cfg, k)
    clock.topology = "ring" if runtime == "collective" else "star"
    if links is not None:
        clock.bandwidth_mbps = links
    if cfg.method in ("dp", "single"):
        step_bytes = shapes.param_bytes(cfg) if k > 1 and cfg.method == "dp" else 0
        wall = cfg.rounds * dp_steps_s(clock, k, cfg.inner_steps, step_bytes)
        steps = cfg.rounds * cfg.inner_steps
        return {
            "wall_s": wall,
            "busy_s": [steps * s for s in clock.step_s[:k]],
            "bytes_sent": [steps * step_bytes] * k,
            "bytes_received": [steps * step_bytes] * k,
            "rounds": cfg.rounds,
        }
    units = cfg.fragments if cfg.streaming.on else 1
    model = StandIn(units)
    up, down = upload_codec(cfg), download_codec(cfg)
    side = PlanSide(
        model,
        k,
        update=async_rule(cfg) if cfg.method == "async" else outer_opt(cfg),
        codec=Sized(up, shapes.sizes(cfg, up, units)),
        download=Sized(down, shapes.sizes(cfg, down, units)),
        float_sizes=shapes.sizes(cfg, Fp32Codec(), units),
        drop_prob=cfg.drop_prob,
        after_drop=cfg.after_drop,
        seed=cfg.seed,
    )
    pool = PlanPool(k, side.codec, side.params)
    out: dict[str, Any] = {}
    trainer = simulator(cfg, side, pool, clock, [1] * k)
    if isinstance(trainer, AsyncDiLoCo):
        trainer.probe_job = runtime == "server"
        staleness: list[int] = []
        first: dict[int, tuple[float, float]] = {}  # worker -> (its first push, its first job's compute)
        last: dict[int, float] = {}

        def arrived(a: Arrival) -> None:
            staleness.append(a.staleness)
            first.setdefault(a.worker, (a.sim_time_s, trainer.busy_s[a.worker]))
            last[a.worker] = a.sim_time_s

        trainer.run(arrived)
        out["mean_staleness"] = sum(staleness) / len(staleness) if staleness else 0.0
        out["updates"] = len(staleness)
        # each worker's time training as the server's summary counts it (rundir/summary.py): its
        # first job's compute, then from its first push to its last
        out["train_s"] = [first[w][1] + last[w] - first[w][0] if w in first else 0.0 for w in range(k)]
        rounds = cfg.rounds
    else:
        rounds = _run_sync(cfg, trainer)
    out.update(
        wall_s=trainer.sim_time_s,
        busy_s=list(trainer.busy_s),
        bytes_sent=list(side.bytes_sent),
        bytes_received=list(side.bytes_received),
        rounds=rounds,
    )
    return out


def _run_sync(cfg: TrainConfig, trainer: DiLoCo) -> int:
    """The rounds run/loop.py's `run_sync` would run (workers coming and going, DyLU's budget)."""
    from diloco.core.membership import active_workers, parse_workers_schedule

    schedule = parse_workers_schedule(cfg.workers_schedule, cfg.num_workers) if cfg.workers_schedule else None
    planner, r = trainer.planner, 0
    while (r < cfg.rounds) if planner is None else not planner.done:
        r += 1
        trainer.round(active=active_workers(schedule, r - 1, cfg.rounds) if schedule else None)
    return r


def plan(
    cfg: TrainConfig,
    *,
    links: list[float] | None = None,
    rounds_simulated: int = 50,
    shapes: Shapes | None = None,
    search: bool = True,
    runtime: str = "server",
) -> dict[str, Any]:
    """The prediction for `cfg` (see the module docstring); the fields of `diloco plan --json`.
    `runtime`: what runs it (`simulate`): "server" (default), "collective" (torchrun, `diloco
    plan --runtime collective`) or "sim" (the simulator's own run, which it equals exactly)."""
    if runtime == "collective" and cfg.method == "async":
        raise UserError(
            "asynchronous training runs on a parameter server, not under torchrun: drop --runtime."
        )
    shapes = shapes or Shapes()
    window = min(cfg.rounds, rounds_simulated)
    scale = cfg.rounds / window
    sim = simulate(dataclasses.replace(cfg, rounds=window), shapes, links, runtime)
    wall = sim["wall_s"] * scale
    utilisation, mean = _utilisation(sim)
    result: dict[str, Any] = {
        "method": cfg.method,
        "runtime": runtime,
        "workers": cfg.num_workers,
        "inner_steps": cfg.inner_steps,
        "codec": cfg.communication.codec,
        "fragments": cfg.fragments if cfg.streaming.on else 1,
        "rounds": cfg.rounds,
        "rounds_simulated": window,
        "wall_time_s": wall,
        "round_time_s": wall / cfg.rounds,
        "utilisation": {"per_worker": utilisation, "mean": mean},
        "bytes_per_worker": {
            "sent": [round(b * scale) for b in sim["bytes_sent"]],
            "received": [round(b * scale) for b in sim["bytes_received"]],
        },
    }
    if cfg.method == "async":
        sync = simulate(_as_sync(cfg, window), shapes, links, runtime)
        result["train_s"] = [t * scale for t in sim["train_s"]]
        result["mean_staleness"] = sim["mean_staleness"]
        result["speedup_vs_sync"] = sync["wall_s"] / sim["wall_s"] if sim["wall_s"] > 0 else None
    if search:
        short = dataclasses.replace(cfg, rounds=min(window, SEARCH_ROUNDS))
        result["bandwidth_for_95pct_mbps"] = bandwidth_for(
            short, lambda c, lk: simulate(c, shapes, lk, runtime)
        )
    return result


def _utilisation(sim: dict[str, Any]) -> tuple[list[float], float]:
    """Each worker's compute utilisation and the run's, as a real run's summary counts them
    (rundir/summary.py): sync, its seconds computing ÷ the run's wall time (the mean of them);
    async, ÷ its own time training (`train_s`), and Σ computing ÷ Σ training."""
    busy = sim["busy_s"]
    spans = sim.get("train_s") or [sim["wall_s"]] * len(busy)
    per = [b / t if t > 0 else 0.0 for b, t in zip(busy, spans, strict=True)]  # 0: it never worked
    return per, sum(busy) / sum(spans) if sum(spans) > 0 else 0.0


def _as_sync(cfg: TrainConfig, rounds: int) -> TrainConfig:
    """Sync DiLoCo at the same workers, H, rounds (equal local steps), codec and clock."""
    return dataclasses.replace(cfg, method="diloco", rounds=rounds, async_=AsyncConfig(), dylu=DyluConfig())


def bandwidth_for(
    cfg: TrainConfig, run: Callable[[TrainConfig, list[float]], dict[str, Any]]
) -> list[float | None]:
    """Each worker's least link (Mbit/s, every worker's set to it; latency as given) at which its
    compute utilisation is at least TARGET × what it is on an unlimited link: a bisection in
    log-space, all workers at once, to 1%. None for a worker whose link does not matter (no
    message crosses it, or it computes nothing) or that never reaches it below 1e9 Mbit/s."""
    k = cfg.num_workers

    def util(mbps: float) -> list[float]:
        return _utilisation(run(cfg, [mbps] * k))[0]

    goal = [TARGET * u for u in util(0.0)]  # 0: unlimited
    lo, hi = [1e-3] * k, [1e9] * k
    slowest, fastest = util(lo[0]), util(hi[0])
    need: list[float | None] = [None] * k
    open_ = [w for w in range(k) if goal[w] > 0 and slowest[w] < goal[w] <= fastest[w]]
    while open_:
        w = max(open_, key=lambda i: hi[i] / lo[i])
        if hi[w] / lo[w] <= 1.01:
            break
        mid = math.sqrt(lo[w] * hi[w])
        for i, u in enumerate(util(mid)):
            if i in open_ and lo[i] < mid < hi[i]:
                if u >= goal[i]:
                    hi[i] = mid
                else:
                    lo[i] = mid
    for w in open_:
        need[w] = hi[w]
    return need
