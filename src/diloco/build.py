"""Build a run's pieces from a TrainConfig: data, workers, clock, and the runtime object.

Everything a user can get wrong is checked here, before the run directory exists.

    python -c "from diloco.build import prepare_data; from diloco.config import TrainConfig; \
print(len(prepare_data(TrainConfig()).shards))"
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from diloco import faults
from diloco.async_rules import build_async_rule
from diloco.codec import build_codec, codec_for
from diloco.config import InnerConfig, TrainConfig
from diloco.data import ShardSampler, ShardSet, eval_windows, load_corpus, make_shards, validation_tokens
from diloco.errors import UserError
from diloco.inner import Worker
from diloco.model import GPT
from diloco.outer import Fragmented, OuterOpt, build_outer_opt
from diloco.outer_side import OuterSide
from diloco.runtime.async_sim import AsyncDiLoCo
from diloco.runtime.clock import Clock, parse_slowdown, profile
from diloco.runtime.pool import InlinePool, ProcessPool, balanced_assignment
from diloco.runtime.sim import DataParallel, DiLoCo, make_worker
from diloco.schedule import warmup_cosine
from diloco.streaming import Schedule


@dataclass
class Data:
    shards: list[torch.Tensor]
    weights: list[float]
    eval_subset: torch.Tensor  # (N, T+1) fixed windows for periodic evals
    eval_full: torch.Tensor  # (M, T+1) the whole validation split


def prepare_data(cfg: TrainConfig) -> Data:
    works = load_corpus()
    k = 1 if cfg.method == "single" else cfg.num_workers
    shards, weights = make_shards(
        works, k, kind=cfg.data.shards, val_fraction=cfg.data.val_fraction, seed=cfg.seed
    )
    for i in range(k):
        sampler(cfg, shards, i)  # a shard too small for one batch is a UserError now, not later
    val = validation_tokens(works, cfg.data.val_fraction)
    return Data(
        shards,
        weights,
        eval_windows(val, cfg.model.seq_len, cfg.data.eval_windows),
        eval_windows(val, cfg.model.seq_len),
    )


def sampler(cfg: TrainConfig, shards: list[torch.Tensor], i: int, batch_multiple: int = 1) -> ShardSampler:
    return ShardSampler(
        shards[i],
        batch_size=cfg.data.batch_size * batch_multiple,
        seq_len=cfg.model.seq_len,
        seed=cfg.seed * 1_000_003 + i,
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


def build_worker(w: int, cfg: TrainConfig, shards: list[torch.Tensor], batch_multiple: int = 1) -> Worker:
    """Worker w of a CLI run (module-level, so worker processes can build it). A worker made of
    M ranks (collective runtime) draws batches of M × batch_size rows and splits them."""
    batches = ShardSet([sampler(cfg, shards, i, batch_multiple) for i in range(len(shards))], current=w)
    worker = make_worker(
        partial(GPT, cfg.model),
        partial(adamw, inner=cfg.inner),
        batches,
        lr_schedule=lr_schedule(cfg),
        grad_clip=cfg.inner.grad_clip,
        codec=codec_for(cfg),
    )
    return faults.wrap_worker(worker, w)


def build_pool(cfg: TrainConfig, data: Data) -> InlinePool | ProcessPool:
    """Workers compute with one intra-op thread each, inline or in `procs` processes, so the
    results do not depend on the number of processes."""
    factory = partial(build_worker, cfg=cfg, shards=data.shards)
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


def load_init(cfg: TrainConfig) -> dict[str, torch.Tensor] | None:
    """The parameters `--init-from` names (a run directory's model.safetensors, or that file),
    checked against the model `cfg` builds; None without --init-from."""
    if not cfg.init_from:
        return None
    path = Path(cfg.init_from)
    fix = "give a finished run directory or a model.safetensors file of the same model"
    if path.is_dir():
        if not (path / "model.safetensors").is_file():
            raise UserError(f"--init-from {path} has no model.safetensors (has that run finished?); {fix}.")
        path = path / "model.safetensors"
    if not path.is_file():
        raise UserError(f"--init-from {path} does not exist; {fix}.")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"--init-from {path} is not a readable safetensors file ({e}); {fix}.") from None
    with torch.device("meta"):  # shapes only: nothing allocated
        want = {k: v.shape for k, v in GPT(cfg.model).state_dict().items()}
    got = {k: v.shape for k, v in tensors.items()}
    for name in sorted(want.keys() | got.keys()):
        if want.get(name) != got.get(name):
            there = tuple(got[name]) if name in got else "missing"
            here = tuple(want[name]) if name in want else "absent"
            shapes = f"{there} there, {here} here"
            raise UserError(
                f"--init-from {path} does not fit this model: {name} is {shapes}; "
                "use the model settings (--model, [model]) of the run it came from."
            )
    return tensors


def initial_model(cfg: TrainConfig, init: dict[str, torch.Tensor] | None) -> GPT:
    """The global model at the start: from `cfg.seed`, then `init`'s parameters if given."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    if init is not None:
        model.load_state_dict(init)
    return model


def build_side(cfg: TrainConfig, data: Data, init: dict[str, torch.Tensor] | None = None) -> OuterSide:
    """The outer side of a DiLoCo or async run: the global model (from `cfg.seed`, or `init`),
    the outer optimizer or async rule, the codec and the shard weights."""
    return OuterSide(
        initial_model(cfg, init),
        cfg.num_workers,
        update=_async_rule(cfg) if cfg.method == "async" else outer_opt(cfg),
        codec=codec_for(cfg),
        download=build_codec(cfg.download_codec),
        weights=None if cfg.method == "async" else data.weights,
        drop_prob=cfg.drop_prob,
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
    if cfg.runtime == "collective":
        from diloco.runtime.collective import CollectiveDiLoCo

        return CollectiveDiLoCo(cfg, data.shards, data.weights, build_worker=build_worker, init=init)
    if cfg.runtime == "server":
        from diloco.runtime.server.service import ServerRuntime

        assert run_dir is not None, "the server runtime needs its run directory"
        return ServerRuntime(cfg, build_side(cfg, data, init), [len(s) for s in data.shards], run_dir, serve)
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
    if cfg.method == "diloco":
        return DiLoCo.from_side(
            side, pool, clock, inner_steps=cfg.inner_steps, schedule=streaming_schedule(cfg)
        )
    return AsyncDiLoCo.from_config(cfg, side, pool, clock, shard_sizes=[len(s) for s in data.shards])


def streaming_schedule(cfg: TrainConfig) -> Schedule | None:
    """Streaming DiLoCo's schedule (--fragments, --overlap-steps), or None for plain DiLoCo."""
    if cfg.fragments == 1 and cfg.overlap_steps == 0:
        return None
    return Schedule(cfg.inner_steps, cfg.fragments, cfg.overlap_steps, cfg.mix_alpha)


def outer_opt(cfg: TrainConfig) -> OuterOpt:
    """The sync outer optimizer: one, or one per fragment for Streaming DiLoCo."""
    if streaming_schedule(cfg) is None:
        return build_outer_opt(cfg.outer)
    return Fragmented([build_outer_opt(cfg.outer) for _ in range(cfg.fragments)])


def _async_rule(cfg: TrainConfig):
    v = cfg.server
    return build_async_rule(
        v.rule,
        lr=cfg.outer.lr,
        momentum=cfg.outer.momentum,
        num_workers=cfg.num_workers,
        buffer=v.buffer,
        c=v.dn_c,
        poly_threshold=v.poly_threshold,
        delaycomp_lambda=v.delaycomp_lambda,
    )
