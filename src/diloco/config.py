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

METHODS = ("diloco", "single", "dp")
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
    eval_every: int = 50  # evaluate after the round in which a multiple of this many steps falls
    checkpoint_every: int = 0  # rounds between checkpoints; 0 saves none
    codec: str = "fp32"  # how outer_grads are encoded on the wire
    out: str = ""  # run directory; empty means runs/<method>-k<workers>-H<steps>-s<seed>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)

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


def _float(key: str, value: Any, *, lo: float, hi: float = math.inf, lo_open: bool = False):
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_num and math.isfinite(value) and value <= hi
    ok = ok and (value > lo if lo_open else value >= lo)
    bound = f"> {lo}" if lo_open else f">= {lo}"
    want = f"a finite number {bound}" + (f" and <= {hi}" if hi != math.inf else "")
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
    _int("eval_every", cfg.eval_every, minimum=1)
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
    _float("inner.beta1", i.beta1, lo=0.0, hi=1.0)
    _float("inner.beta2", i.beta2, lo=0.0, hi=1.0)
    _float("inner.grad_clip", i.grad_clip, lo=0.0)
    o = cfg.outer
    _choice("outer.opt", o.opt, OUTER_OPTS)
    _float("outer.lr", o.lr, lo=0.0, lo_open=True)
    _float("outer.momentum", o.momentum, lo=0.0, hi=1.0)
    _float("outer.adam_beta1", o.adam_beta1, lo=0.0, hi=1.0)
    _float("outer.adam_beta2", o.adam_beta2, lo=0.0, hi=1.0)
    _float("outer.adam_eps", o.adam_eps, lo=0.0, lo_open=True)


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "inner": InnerConfig, "outer": OuterConfig}


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
            if preset not in MODEL_PRESETS:
                raise UserError(
                    f"unknown model {preset!r} (--model); use one of: {', '.join(MODEL_PRESETS)}."
                )
            base = MODEL_PRESETS[preset]
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
