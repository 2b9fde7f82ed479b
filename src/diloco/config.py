"""Configuration: one frozen dataclass per component, every field documented, model presets.

A config comes from defaults, then a TOML file (`--config`), then CLI flags, in that order.
The resolved config is saved as `config.json` in the run directory and read back by `--resume`.
Every check a user can fail raises `UserError` with one sentence naming the field and the fix.

    diloco train --config my.toml --workers 8
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.errors import UserError

METHODS = ("diloco", "async", "single", "dp")
RUNTIMES = ("sim", "collective")
ASYNC_RULES = ("dn", "naive", "buffer", "poly", "polythres", "delaycomp")
HETEROGENEITY = ("none", "slight", "moderate", "very")
SHARDINGS = ("iid", "genre", "kmeans")
OUTER_OPTS = ("nesterov", "sgd", "adam")
CODECS = ("fp32",)


@dataclass(frozen=True)
class ModelConfig:
    """A small GPT: pre-norm blocks, causal attention, GELU MLP, tied embeddings."""

    name: str = "nano"  # the preset this config started from (see MODEL_PRESETS)
    vocab_size: int = 256  # byte-level tokenizer by default
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 96
    seq_len: int = 128  # context length; also the length of every training window


# Presets are named after what they were checked on. `20m` is the async paper's 20M model
# (6 layers, d=256, 4 heads, sequence 256); its parameter count assumes the paper's 32k vocabulary
# with an untied output head, so it is built with that vocabulary (byte tokens use the first 256
# rows). It is meant for GPUs; here it only has to build and take a step.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "nano": ModelConfig(name="nano", n_layer=4, n_head=4, d_model=96, seq_len=128),
    "micro": ModelConfig(name="micro", n_layer=6, n_head=6, d_model=192, seq_len=128),
    "20m": ModelConfig(name="20m", vocab_size=32_000, n_layer=6, n_head=4, d_model=256, seq_len=256),
}


@dataclass(frozen=True)
class DataConfig:
    """The bundled corpus, its validation split and how it is cut into worker shards."""

    shards: str = "iid"  # iid | genre (non-i.i.d. by genre) | kmeans (non-i.i.d. by TF-IDF)
    batch_size: int = 16  # sequences per inner step, per worker
    val_fraction: float = 0.05  # the last fraction of every work is held out for validation
    eval_windows: int = 64  # windows in the fixed validation subset used by periodic evals


@dataclass(frozen=True)
class InnerConfig:
    """Each worker's AdamW: linear warm-up then cosine decay over its own step count."""

    lr: float = 1e-3  # peak lr; the paper's 4e-4 is for 150M models and 88k steps
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer applied to the averaged outer_grad (ALGORITHMS.md §1)."""

    opt: str = "nesterov"  # nesterov | sgd (lr 1.0, momentum 0 is FedAvg) | adam
    lr: float = 0.7  # the paper's best; adam wants far less (around 0.1 or below)
    momentum: float = 0.9  # nesterov and sgd
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 0.1  # the paper: outer Adam needs eps around 0.1 to be stable


@dataclass(frozen=True)
class SimConfig:
    """The simulator's virtual clock and how many processes compute workers (docs/async.md)."""

    speeds: tuple[float, ...] = ()  # seconds per inner step of each worker; overrides heterogeneity
    heterogeneity: str = "none"  # none | slight | moderate | very (spread 1x, 1.5x, 3x, 6x)
    speed_jitter: float = 0.0  # per-round relative jitter: time per step × (1 + jitter·U[-1, 1])
    slowdowns: tuple[str, ...] = ()  # "W:FACTOR@START-END": worker W FACTOR× slower in [START, END) s
    bandwidth_mbps: float = 0.0  # network bandwidth per message; 0 means unlimited
    latency_ms: float = 0.0  # added to every pull and push
    procs: int = 0  # processes computing workers (one thread each); 0 means one per core


@dataclass(frozen=True)
class ServerConfig:
    """The asynchronous server (`--method async`): its update rule and how it hands out work."""

    rule: str = "dn"  # dn | naive | buffer | poly | polythres | delaycomp
    buffer: int = 0  # N for dn and buffer; 0 means the number of workers
    dn_c: float = 0.0  # c in [0, 1/N]: share of momentum applied on non-momentum arrivals
    poly_threshold: int = 10  # polythres drops updates more stale than this
    delaycomp_lambda: float = 0.5  # λ of delay compensation
    dylu: bool = False  # dynamic local updates: H_w = max(1, floor(v_w / max v · H))
    dylu_oracle: bool = False  # DyLU from the true speed profile instead of measured speeds
    dylu_alpha: float = 0.5  # weight of the newest measurement in the speed estimate (EMA)
    shard_sampling: bool = False  # hand out shards by p_i ∝ max(|D_i|/Σ|D| − n_i/Σn, 0)
    grace_s: float = 0.0  # after an update, also sync workers finishing within this; inf = sync


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `diloco train` with no flags runs exactly these defaults."""

    method: str = "diloco"  # diloco | single (one worker, plain AdamW) | dp (data parallel)
    num_workers: int = 4  # k
    inner_steps: int = 50  # H: inner steps per round
    rounds: int = 6  # outer steps; every worker runs rounds * inner_steps inner steps
    seed: int = 0
    # Intra-op threads; 0 means every core this process may use. benchmarks/overhead.py measured
    # one process on 2 cores: 2 threads give 1.7x the tokens/s of 1 (results/overhead.json).
    threads: int = 0
    eval_every: int = 0  # inner steps between evaluations (a multiple of H); 0 means every round
    checkpoint_every: int = 0  # rounds between checkpoints; 0 saves none
    codec: str = "fp32"  # how outer_grads are encoded on the wire
    out: str = ""  # run directory; empty means runs/<method>-k<workers>-H<steps>-s<seed>
    target_loss: float = 0.0  # summary reports when the validation loss first reached it; 0: off
    runtime: str = "sim"  # sim (one process) | collective (torch.distributed, launched by torchrun)
    procs_per_worker: int = 1  # collective: ranks per worker, doing data parallel on its shard
    bucket_mb: float = 25.0  # collective: outer_grads are all-reduced in buckets of this size
    drop_prob: float = 0.0  # each round each outer_grad is lost with this probability
    workers_schedule: str = ""  # active workers over training, e.g. "0:4,0.5:8"; empty: all
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def total_inner_steps(self) -> int:
        """Inner steps every worker runs over the whole run."""
        return self.rounds * self.inner_steps

    @property
    def resolved_threads(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))

    @property
    def resolved_procs(self) -> int:
        return self.sim.procs or len(os.sched_getaffinity(0))

    @property
    def run_dir(self) -> Path:
        name = f"{self.method}-k{self.num_workers}-H{self.inner_steps}-s{self.seed}"
        return Path(self.out) if self.out else Path("runs") / name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Flag names, for error messages that tell a CLI user what to change.
_FLAGS = {
    "num_workers": "--workers",
    "inner_steps": "--inner-steps",
    "rounds": "--rounds",
    "seed": "--seed",
    "threads": "--threads",
    "eval_every": "--eval-every",
    "checkpoint_every": "--checkpoint-every",
    "method": "--method",
    "codec": "--codec",
    "model.name": "--model",
    "model.seq_len": "--seq-len",
    "data.batch_size": "--batch-size",
    "data.shards": "--shards",
    "inner.lr": "--inner-lr",
    "outer.opt": "--outer-opt",
    "outer.lr": "--outer-lr",
    "outer.momentum": "--outer-momentum",
    "target_loss": "--target-loss",
    "runtime": "--runtime",
    "procs_per_worker": "--procs-per-worker",
    "bucket_mb": "--bucket-mb",
    "drop_prob": "--drop-prob",
    "workers_schedule": "--workers-schedule",
    "sim.speeds": "--speeds",
    "sim.heterogeneity": "--heterogeneity",
    "sim.speed_jitter": "--speed-jitter",
    "sim.slowdowns": "--slowdown",
    "sim.bandwidth_mbps": "--bandwidth-mbps",
    "sim.latency_ms": "--latency-ms",
    "sim.procs": "--procs",
    "server.rule": "--async-rule",
    "server.buffer": "--dn-buffer",
    "server.dn_c": "--dn-c",
    "server.poly_threshold": "--poly-threshold",
    "server.delaycomp_lambda": "--delaycomp-lambda",
    "server.dylu_alpha": "--dylu-alpha",
    "server.grace_s": "--grace-s",
}


def _name(key: str) -> str:
    flag = _FLAGS.get(key)
    return f"{key} ({flag})" if flag else key


def _check(ok: bool, key: str, value: Any, want: str) -> None:
    if not ok:
        raise UserError(f"{_name(key)} must be {want}, got {value!r}; set it to {want}.")


def _int(key: str, value: Any, *, minimum: int) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    _check(is_int and value >= minimum, key, value, f"an integer >= {minimum}")


def _float(
    key: str, value: Any, *, lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False
) -> None:
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_num and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    want = f"a finite number {'>' if lo_open else '>='} {lo}"
    if hi != math.inf:
        want += f" and {'<' if hi_open else '<='} {hi}"
    _check(ok, key, value, want)


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, value, "one of " + ", ".join(choices))


def validate(cfg: TrainConfig) -> None:
    """Reject every setting that cannot run, naming the field and the fix."""
    _choice("method", cfg.method, METHODS)
    _choice("codec", cfg.codec, CODECS)
    _int("num_workers", cfg.num_workers, minimum=1)
    _int("inner_steps", cfg.inner_steps, minimum=1)
    _int("rounds", cfg.rounds, minimum=1)
    _int("seed", cfg.seed, minimum=0)
    _int("threads", cfg.threads, minimum=0)
    _int("eval_every", cfg.eval_every, minimum=0)
    if cfg.eval_every and cfg.method != "async" and cfg.eval_every % cfg.inner_steps:
        raise UserError(
            f"eval_every (--eval-every) must be a multiple of inner_steps ({cfg.inner_steps}), got "
            f"{cfg.eval_every}: the global model exists only between rounds; use 0 for every round."
        )
    _int("checkpoint_every", cfg.checkpoint_every, minimum=0)
    m = cfg.model
    _int("model.vocab_size", m.vocab_size, minimum=256)
    _int("model.n_layer", m.n_layer, minimum=1)
    _int("model.n_head", m.n_head, minimum=1)
    _int("model.d_model", m.d_model, minimum=1)
    _int("model.seq_len", m.seq_len, minimum=2)
    if m.d_model % m.n_head:
        raise UserError(
            f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head}); change one of them."
        )
    d = cfg.data
    _choice("data.shards", d.shards, SHARDINGS)
    _int("data.batch_size", d.batch_size, minimum=1)
    _float("data.val_fraction", d.val_fraction, lo=0.0, hi=0.5, lo_open=True)
    _int("data.eval_windows", d.eval_windows, minimum=1)
    i = cfg.inner
    _float("inner.lr", i.lr, lo=0.0, lo_open=True)
    _int("inner.warmup_steps", i.warmup_steps, minimum=0)
    _float("inner.min_lr_ratio", i.min_lr_ratio, lo=0.0, hi=1.0)
    _float("inner.weight_decay", i.weight_decay, lo=0.0)
    _float("inner.beta1", i.beta1, lo=0.0, hi=1.0, hi_open=True)
    _float("inner.beta2", i.beta2, lo=0.0, hi=1.0, hi_open=True)
    _float("inner.grad_clip", i.grad_clip, lo=0.0)
    o = cfg.outer
    _choice("outer.opt", o.opt, OUTER_OPTS)
    _float("outer.lr", o.lr, lo=0.0, lo_open=True)
    _float("outer.momentum", o.momentum, lo=0.0, hi=1.0, hi_open=True)
    _float("outer.adam_beta1", o.adam_beta1, lo=0.0, hi=1.0, hi_open=True)
    _float("outer.adam_beta2", o.adam_beta2, lo=0.0, hi=1.0, hi_open=True)
    _float("outer.adam_eps", o.adam_eps, lo=0.0, lo_open=True)
    _float("target_loss", cfg.target_loss, lo=0.0)
    _choice("runtime", cfg.runtime, RUNTIMES)
    _int("procs_per_worker", cfg.procs_per_worker, minimum=1)
    _float("bucket_mb", cfg.bucket_mb, lo=0.0, lo_open=True)
    _float("drop_prob", cfg.drop_prob, lo=0.0, hi=1.0, hi_open=True)
    if cfg.workers_schedule:
        from diloco.schedule import parse_workers_schedule

        try:
            parse_workers_schedule(cfg.workers_schedule, cfg.num_workers)
        except (ValueError, TypeError, AttributeError):
            raise UserError(
                f"workers_schedule (--workers-schedule) must be FRACTION:WORKERS pairs like "
                f"'0:4,0.5:8', starting at 0, fractions rising below 1, 1 to num_workers "
                f"({cfg.num_workers}) workers, got {cfg.workers_schedule!r}; fix it."
            ) from None
    if (cfg.drop_prob or cfg.workers_schedule) and cfg.method != "diloco":
        raise UserError("--drop-prob and --workers-schedule apply to --method diloco; drop them.")
    if cfg.runtime == "collective" and cfg.method != "diloco":
        raise UserError("the collective runtime runs --method diloco only; use --runtime sim for others.")
    _validate_sim(cfg)
    _validate_server(cfg)


def _validate_sim(cfg: TrainConfig) -> None:
    from diloco.runtime.clock import parse_slowdown

    s = cfg.sim
    _choice("sim.heterogeneity", s.heterogeneity, HETEROGENEITY)
    _check(
        isinstance(s.speeds, tuple)
        and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in s.speeds),
        "sim.speeds",
        s.speeds,
        "a list of positive seconds per inner step, one per worker",
    )
    if s.speeds and len(s.speeds) != cfg.num_workers:
        raise UserError(
            f"sim.speeds (--speeds) gives {len(s.speeds)} speeds for {cfg.num_workers} workers; "
            "give one per worker."
        )
    _float("sim.speed_jitter", s.speed_jitter, lo=0.0, hi=0.99)
    _float("sim.bandwidth_mbps", s.bandwidth_mbps, lo=0.0)
    _float("sim.latency_ms", s.latency_ms, lo=0.0)
    _int("sim.procs", s.procs, minimum=0)
    for text in s.slowdowns:
        try:
            d = parse_slowdown(text)
            ok = 0 <= d.worker < cfg.num_workers and d.factor > 0 and d.start_s < d.end_s
        except (ValueError, TypeError, AttributeError):
            ok = False
        _check(ok, "sim.slowdowns", text, "W:FACTOR@START-END with a valid worker, e.g. 2:4@100-200")


def _validate_server(cfg: TrainConfig) -> None:
    v = cfg.server
    _choice("server.rule", v.rule, ASYNC_RULES)
    _int("server.buffer", v.buffer, minimum=0)
    n = v.buffer or cfg.num_workers
    _float("server.dn_c", v.dn_c, lo=0.0, hi=1.0 / n)
    _int("server.poly_threshold", v.poly_threshold, minimum=0)
    _float("server.delaycomp_lambda", v.delaycomp_lambda, lo=0.0)
    _float("server.dylu_alpha", v.dylu_alpha, lo=0.0, hi=1.0, lo_open=True)
    grace_ok = isinstance(v.grace_s, (int, float)) and not math.isnan(v.grace_s) and v.grace_s >= 0
    _check(grace_ok, "server.grace_s", v.grace_s, "a number of seconds >= 0 (inf: wait for all)")
    for name in ("dylu", "dylu_oracle", "shard_sampling"):
        _check(isinstance(getattr(v, name), bool), f"server.{name}", getattr(v, name), "true or false")
    async_only = [f for f in ("dylu", "dylu_oracle", "shard_sampling") if getattr(v, f)]
    if async_only and cfg.method != "async":
        raise UserError(
            f"server.{async_only[0]} applies to the asynchronous server only; add --method async or drop it."
        )
    if cfg.method == "async" and cfg.checkpoint_every:
        raise UserError("checkpoints are not supported yet for --method async; drop --checkpoint-every.")


_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "inner": InnerConfig,
    "outer": OuterConfig,
    "sim": SimConfig,
    "server": ServerConfig,
}
_TUPLES = {("sim", "speeds"), ("sim", "slowdowns")}  # JSON and TOML give lists


def _known(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _section(cls: type, values: dict[str, Any], where: str, base: Any | None = None) -> Any:
    unknown = sorted(set(values) - _known(cls))
    if unknown:
        raise UserError(
            f"unknown key {unknown[0]!r} in {where}; use one of: {', '.join(sorted(_known(cls)))}."
        )
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def from_dict(values: dict[str, Any], where: str = "the config") -> TrainConfig:
    """Build a config from nested dicts (a parsed TOML file, config.json, or CLI overrides).

    `model.name` picks a preset; the other model keys then override it.
    """
    values = dict(values)
    sections = {}
    for key, cls in _SECTIONS.items():
        sub = values.pop(key, {}) or {}
        if not isinstance(sub, dict):
            raise UserError(f"{key} in {where} must be a table of settings, got {sub!r}.")
        base = None
        if key == "model":
            preset = sub.get("name", "nano")
            if not isinstance(preset, str) or preset not in MODEL_PRESETS:
                raise UserError(
                    f"unknown model {preset!r} (--model); use one of: {', '.join(MODEL_PRESETS)}."
                )
            base = MODEL_PRESETS[preset]
        sub = {f: tuple(v) if (key, f) in _TUPLES and isinstance(v, list) else v for f, v in sub.items()}
        sections[key] = _section(cls, sub, f"[{key}] of {where}", base)
    unknown = sorted(set(values) - _known(TrainConfig))
    if unknown:
        raise UserError(
            f"unknown key {unknown[0]!r} in {where}; top-level keys are: "
            + ", ".join(sorted(_known(TrainConfig) - set(_SECTIONS)))
            + f", and the tables [{'], ['.join(_SECTIONS)}]."
        )
    try:
        return TrainConfig(**values, **sections)
    except TypeError as e:  # a value of a type dataclasses cannot even hold
        raise UserError(f"bad value in {where}: {e}; fix that setting.") from None


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base` (nested tables merge key by key)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; check the path given to --config.")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file {path} is not valid TOML ({e}); fix its syntax.") from None


def load_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; is this a diloco run directory?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); the run directory is corrupt.") from None
