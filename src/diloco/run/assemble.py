"""The one place that assembles a run from its TrainConfig: the workers (model replica, inner
optimizer, batches, codec), the pool that computes them, the clock, the outer side (the global
model, the outer optimizer or async rule, the codecs, the shard weights) and the runtime that
moves messages between them. Each component is built here once and handed to the runtime that
uses it (simulator, async simulator, collective, server; the server worker and replay build
their workers and codecs here too); no runtime builds its own.

    python -c "from diloco.run.assemble import build_trainer; from diloco.data.recipe import prepare_data; \
from diloco.config import TrainConfig; c = TrainConfig(); \
print(build_trainer(c, prepare_data(c)).num_workers)"
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from diloco.config import InnerConfig, TrainConfig
from diloco.config.parsers import parse_slowdown
from diloco.core.async_rules import AsyncRule
from diloco.core.codec import Codec
from diloco.core.dylu import RoundPlanner
from diloco.core.inner import Worker
from diloco.core.lr import warmup_cosine
from diloco.core.outer import Fragmented, OuterOpt
from diloco.core.outer_side import OuterSide
from diloco.core.streaming import Schedule
from diloco.data.batches import ShardSet
from diloco.data.recipe import Data, sampler
from diloco.data.tokens import View
from diloco.model.init import build_model, initial_model
from diloco.runtime import faults
from diloco.runtime.async_sim import AsyncDiLoCo
from diloco.runtime.clock import Clock, profile
from diloco.runtime.data_parallel import DataParallel
from diloco.runtime.pool import InlinePool, ProcessPool, balanced_assignment
from diloco.runtime.sim import DiLoCo, make_worker


def small_shards(cfg: TrainConfig, data: Data) -> str | None:
    """A warning when shards hold fewer tokens than their worker reads in one round (H steps of
    batch_size × seq_len): those workers see the same text over and over, and their outer_grads
    get small weights (|D_i| / Σ|D_j|). None when every shard is large enough."""
    ranks = cfg.procs_per_worker  # 1 but for collective and server runs
    per_round = cfg.inner_steps * cfg.data.batch_size * cfg.model.seq_len * ranks
    small = [(i, len(s), w) for i, (s, w) in enumerate(zip(data.shards, data.weights, strict=True))]
    small = [x for x in small if x[1] < per_round]
    if not small:
        return None
    listed = ", ".join(f"worker {i} {n:,} (weight {w:.4f})" for i, n, w in small[:8])
    more = f" and {len(small) - 8} more" if len(small) > 8 else ""
    fixes = "fewer --workers, " if len(data.shards) > 1 else ""
    fixes += "--shards iid, " if cfg.data.shards != "iid" and len(data.shards) > 1 else ""
    return (
        f"{len(small)} of {len(data.shards)} shards hold fewer tokens than their worker reads in a round "
        f"({per_round:,}): {listed}{more}; they will repeat the same text"
        + (" and their outer_grads count little" if cfg.data.shards != "iid" else "")
        + f": use {fixes}a smaller --inner-steps or --batch-size, or more text."
    )


def adamw(params, inner: InnerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=inner.lr, betas=(inner.beta1, inner.beta2), weight_decay=inner.weight_decay
    )


def lr_schedule(cfg: TrainConfig):
    i = cfg.inner
    return partial(
        warmup_cosine,
        lr=i.lr,
        warmup_steps=i.warmup_steps,
        total_steps=cfg.total_inner_steps,
        min_lr_ratio=i.min_lr_ratio,
    )


def build_worker(w: int, cfg: TrainConfig, shards: list[View], batch_multiple: int = 1) -> Worker:
    """Worker w of a CLI run (module-level, so worker processes can build it). A worker made of
    M ranks (collective runtime) draws batches of M × batch_size rows and splits them."""
    batches = ShardSet([sampler(cfg, shards, i, batch_multiple) for i in range(len(shards))], current=w)
    worker = make_worker(
        partial(build_model, cfg),
        partial(adamw, inner=cfg.inner),
        batches,
        lr_schedule=lr_schedule(cfg),
        grad_clip=cfg.inner.grad_clip,
        codec=upload_codec(cfg),
    )
    return faults.wrap_worker(worker, w)


def worker_factory(cfg: TrainConfig, data: Data) -> Callable[..., Worker]:
    """`build_worker` for this run's shards: factory(w, batch_multiple=1) is worker w (what a
    pool or a rank calls in its own process)."""
    return partial(build_worker, cfg=cfg, shards=data.shards)


def build_pool(cfg: TrainConfig, data: Data) -> InlinePool | ProcessPool:
    """Workers compute with one intra-op thread each, inline or in `procs` processes, so the
    results do not depend on the number of processes."""
    factory = worker_factory(cfg, data)
    procs = min(cfg.resolved_procs, cfg.num_workers)
    if procs > 1:
        # Sync: every worker computes H steps a round. Async: a worker computes in proportion to
        # its speed (more or longer jobs), so spread the fast ones apart.
        k = cfg.num_workers
        loads = [1.0 / s for s in build_clock(cfg, k).step_s] if cfg.method == "async" else [1.0] * k
        return ProcessPool(factory, k, procs, threads=1, assignment=balanced_assignment(loads, procs))
    return InlinePool([factory(w) for w in range(cfg.num_workers)], threads=1)


def build_clock(cfg: TrainConfig, k: int) -> Clock:
    s = cfg.sim
    return Clock(
        list(s.speeds) if s.speeds else profile(s.heterogeneity, k),
        jitter=s.speed_jitter,
        slowdowns=tuple(parse_slowdown(x) for x in s.slowdowns),
        bandwidth_mbps=s.bandwidth_mbps,
        latency_ms=s.latency_ms,
        seed=cfg.seed,
    )


def build_side(cfg: TrainConfig, data: Data, init: dict[str, torch.Tensor] | None = None) -> OuterSide:
    """The outer side of a DiLoCo or async run: the global model (from `cfg.seed`, or `init`),
    the outer optimizer or async rule, the codec and the shard weights."""
    return OuterSide(
        initial_model(cfg, init),
        cfg.num_workers,
        update=async_rule(cfg) if cfg.method == "async" else outer_opt(cfg),
        codec=upload_codec(cfg),
        download=download_codec(cfg),
        weights=None if cfg.method == "async" else data.weights,
        drop_prob=cfg.drop_prob,
        after_drop=cfg.after_drop,
        seed=cfg.seed,
        on_nonfinite=cfg.on_nonfinite,
    )


def build_trainer(
    cfg: TrainConfig,
    data: Data,
    init: dict[str, torch.Tensor] | None = None,
    *,
    run_dir: Path | None = None,
    serve=None,
):
    """The runtime for `cfg` (see runtime/__init__.py); the global model comes from `cfg.seed`,
    or from `init` (see `load_init`). The server runtime keeps its log in `run_dir` and faces the
    network as `serve` (a ServeOptions) says."""
    if cfg.runtime == "collective":  # under torchrun (runtime/torchrun.py has joined the job)
        from diloco.runtime.collective import CollectiveDiLoCo

        # every rank builds the same side (seed, or --init-from) and its own worker
        side = build_side(cfg, data, init)
        return CollectiveDiLoCo(
            cfg,
            side,
            build_worker=worker_factory(cfg, data),
            schedule=streaming_schedule(cfg),
            planner=round_planner(cfg),
        )
    if cfg.runtime == "server":
        from diloco.runtime.server.service import ServerRuntime

        assert run_dir is not None, "the server runtime needs its run directory"
        side, sizes = build_side(cfg, data, init), [len(s) for s in data.shards]
        return ServerRuntime(cfg, side, sizes, run_dir, serve, shard_plan=data.plan.to_json())
    if cfg.method in ("single", "dp"):
        model = initial_model(cfg, init)
        k = len(data.shards)
        clock = build_clock(cfg, cfg.num_workers)
        return DataParallel(
            lambda: model,
            partial(adamw, inner=cfg.inner),
            [sampler(cfg, data.shards, i) for i in range(k)],
            inner_steps=cfg.inner_steps,
            lr_schedule=lr_schedule(cfg),
            grad_clip=cfg.inner.grad_clip,
            clock=Clock(clock.step_s[:k], bandwidth_mbps=clock.bandwidth_mbps, latency_ms=clock.latency_ms),
        )
    side = build_side(cfg, data, init)  # built before the pool, so the pool cannot change the initialisation
    pool, clock = build_pool(cfg, data), build_clock(cfg, cfg.num_workers)
    return simulator(cfg, side, pool, clock, [len(s) for s in data.shards])


def simulator(cfg: TrainConfig, side: OuterSide, pool, clock: Clock, shard_sizes: list[int]):
    """The simulator of `cfg` over a ready outer side, pool and clock: sync DiLoCo (with its
    Streaming schedule or DyLU planner) or async (`diloco plan` runs it on a stand-in too)."""
    if cfg.method == "diloco":
        return DiLoCo.from_side(
            side,
            pool,
            clock,
            inner_steps=cfg.inner_steps,
            schedule=streaming_schedule(cfg),
            planner=round_planner(cfg),
            dylu_oracle=cfg.dylu.oracle,
        )
    return AsyncDiLoCo.from_config(cfg, side, pool, clock, shard_sizes=shard_sizes)


def round_planner(cfg: TrainConfig) -> RoundPlanner | None:
    """Sync DiLoCo with DyLU (--method diloco --dylu): the planner of each round's H_w, with the
    budget of plain sync (k × rounds × H inner steps); None for plain sync DiLoCo."""
    if cfg.method != "diloco" or not cfg.dylu.on(cfg.method):
        return None
    budget = cfg.num_workers * cfg.total_inner_steps
    return RoundPlanner(
        cfg.num_workers, cfg.inner_steps, budget, by=cfg.dylu.by_for(cfg.method), alpha=cfg.dylu.alpha
    )


def streaming_schedule(cfg: TrainConfig) -> Schedule | None:
    """Streaming DiLoCo's schedule (--fragments, --overlap-steps), or None for plain DiLoCo."""
    return cfg.streaming.build()


def outer_opt(cfg: TrainConfig) -> OuterOpt:
    """The sync outer optimizer: one, or one per fragment for Streaming DiLoCo."""
    if not cfg.streaming.on:
        return cfg.outer.build()
    return Fragmented([cfg.outer.build() for _ in range(cfg.fragments)])


def async_rule(cfg: TrainConfig) -> AsyncRule:
    """With jobs as deadlines (async's default) DN steps its momentum at grace groups' ends."""
    deadlines = cfg.dylu.on(cfg.method) and cfg.dylu.by_for(cfg.method) == "time"
    return cfg.async_.build(cfg.outer, cfg.num_workers, at_group_end=deadlines)


def upload_codec(cfg: TrainConfig) -> Codec:
    """The codec of a worker's outer_grad (--codec, --error-feedback, --topk-fraction)."""
    return cfg.communication.build_upload()


def download_codec(cfg: TrainConfig) -> Codec:
    """The codec of the global parameters a worker downloads (--download-codec)."""
    return cfg.communication.build_download()
