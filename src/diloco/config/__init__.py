"""Configuration: one frozen dataclass per component, every setting declared once, model presets.

A config comes from defaults, then a TOML file (`--config`), then CLI flags, in that order.
Each field declares its default, `diloco train` flag, help text, choices, when it applies and its
group in `--help` with `setting(...)` (diloco.settings); the CLI's flags and the error messages
come from there.
The resolved config is saved as `config.json` in the run directory and read back by `--resume`.
Every check a user can fail raises `UserError` with one sentence naming the field and the fix.
Adding a setting touches its field here, its range check in `validate` and the code that uses it.

    diloco train --config my.toml --workers 8
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco import settings
from diloco.errors import UserError
from diloco.settings import load_json as load_json
from diloco.settings import load_toml as load_toml
from diloco.settings import merge as merge
from diloco.settings import setting

METHODS = ("diloco", "async", "single", "dp")
RUNTIMES = ("sim", "collective", "server")  # server: `diloco serve` (docs/server.md)
ASYNC_RULES = ("dn", "naive", "buffer", "poly", "polythres", "delaycomp")
HETEROGENEITY = ("none", "slight", "moderate", "very")
SHARDINGS = ("iid", "genre", "kmeans", "by-source")
OUTER_OPTS = ("nesterov", "sgd", "adam")
CODECS = ("fp32", "bf16", "int8", "fp4", "topk")  # codec.CODECS, checked by tests
DOWNLOAD_CODECS = ("fp32", "bf16")  # codec.DOWNLOAD_CODECS
ON_NONFINITE = ("stop", "drop")
AFTER_DROP = ("own", "global")  # where the worker of a dropped outer_grad goes on from
PRESETS = (
    "nano",
    "micro",
    "20m",
    "60m",
    "150m",
)  # the keys of MODEL_PRESETS (below), which needs ModelConfig
# `needs` of settings that apply to one runtime or method only (the simulator's clock: not real time)
ON_SIM, ON_COLLECTIVE, ON_SERVER = ("runtime", "sim"), ("runtime", "collective"), ("runtime", "server")
ON_ASYNC, ON_DILOCO = ("method", "async"), ("method", "diloco")
# The groups of `diloco train --help`, in order, by the name a top-level setting gives with `group=`
# (each must give one: tests/unit/test_cli_flags.py). A section's settings are in the section's
# group ("" here: titled by the section's docstring) unless they name another.
FLAG_GROUPS = {
    "run": "the run (method, workers, rounds, seed, runtime)",
    "model": "",
    "data": "",
    "inner": "",
    "outer": "",
    "communication": "compression and Streaming DiLoCo (docs/communication.md)",
    "server": "",
    "sim": "",
    "faults": "faults simulated in sync DiLoCo (the parameter server has real ones)",
    "collective": "the collective runtime (--runtime collective under torchrun, docs/distributed.md)",
    "parameter_server": "the parameter server (diloco serve only, docs/server.md)",
    "output": "checkpoints, evaluation and output",
}


def _grace(text: str) -> float | str:
    """--grace-s: a number of seconds, `auto` or `inf`."""
    return text if text in ("auto", "inf") else float(text)


def _speeds(text: str) -> tuple[float, ...]:
    """--speeds: comma-separated seconds per step."""
    from diloco.runtime.clock import parse_speeds

    try:
        return tuple(parse_speeds(text))
    except ValueError:
        raise ValueError(
            f"--speeds wants positive seconds per step separated by commas, got {text!r}"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """diloco's GPT (pre-norm blocks, causal attention, GELU MLP), or a Hugging Face causal LM."""

    name: str = setting("nano", flag="--model", choices=PRESETS, help="model preset of diloco's GPT")
    # at least the tokenizer's vocabulary: a larger tokenizer (bpe:N, a file) makes it larger
    vocab_size: int = setting(256, help="vocabulary rows of diloco's GPT (at least the tokenizer's)")
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 96
    seq_len: int = setting(128, flag="--seq-len", help="tokens per sequence", default_help="the preset's")
    # the config's JSON text itself (from_dict reads the file), so a run directory, a resumed run
    # and a parameter server's workers all carry the model with them
    hf_config: str = setting(
        "",
        flag="--model-config",
        default_help="diloco's GPT",
        help="a Hugging Face causal-LM config.json (Llama, GPT-2, Qwen, ...), built untrained with "
        "transformers; the preset's sizes then do not apply",
    )


# Presets are named after what they were checked on. `20m` is the async paper's 20M model
# (6 layers, d=256, 4 heads, sequence 256); its parameter count assumes the paper's 32k vocabulary
# with an untied output head, so it is built with that vocabulary (byte tokens use the first 256
# rows). It is meant for GPUs; here it only has to build and take a step.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "nano": ModelConfig(name="nano", n_layer=4, n_head=4, d_model=96, seq_len=128),
    "micro": ModelConfig(name="micro", n_layer=6, n_head=6, d_model=192, seq_len=128),
    "20m": ModelConfig(name="20m", vocab_size=32_000, n_layer=6, n_head=4, d_model=256, seq_len=256),
    # the papers' 60M and 150M models (DiLoCo's table of architectures), for GPU users; with the
    # untied head they hold 87M and 173M parameters (the names count one 32k embedding)
    "60m": ModelConfig(name="60m", vocab_size=32_000, n_layer=3, n_head=16, d_model=896, seq_len=256),
    "150m": ModelConfig(name="150m", vocab_size=32_000, n_layer=12, n_head=16, d_model=896, seq_len=256),
}
assert tuple(MODEL_PRESETS) == PRESETS
# the longest window diloco's GPT takes: attention's cost grows with the square of the window
# (one of 100,000 tokens costs as much as 150 of 8,192), so a longer one would never finish here
GPT_MAX_SEQ_LEN = 8192


@dataclass(frozen=True)
class DataConfig:
    """The training text (the bundled corpus, or --data), its tokenizer, validation and shards."""

    paths: tuple[str, ...] = setting(
        (),
        flag="--data",
        default_help="the bundled Shakespeare",
        help="your text: files, folders, .jsonl/.json/.parquet/.csv, or a datasets save_to_disk folder",
    )
    text_field: str = setting(
        "text", flag="--text-field", help="the text column of jsonl, json, parquet, csv, datasets"
    )
    source_field: str = setting(
        "",
        flag="--source-field",
        default_help="the file",
        help="the column whose value is a row's source (by-source shards)",
    )
    val_data: tuple[str, ...] = setting(
        (),
        flag="--val-data",
        default_help="held out of --data",
        help="validation text instead of --val-fraction",
    )
    tokenizer: str = setting(
        "byte", flag="--tokenizer", help="byte, bpe:N (trained on the training split), or a tokenizer.json"
    )
    cache_dir: str = setting(
        "",
        flag="--cache-dir",
        default_help="$DILOCO_CACHE or ~/.cache/diloco",
        help="where tokenised data is cached",
    )
    # genre, kmeans (TF-IDF) and by-source are non-i.i.d.
    shards: str = setting("iid", flag="--shards", choices=SHARDINGS, help="how workers' shards are cut")
    batch_size: int = setting(16, flag="--batch-size", help="sequences per inner step, per worker")
    val_fraction: float = setting(
        0.05,
        flag="--val-fraction",
        help="held out for validation: the end of every work, or whole documents of --data",
    )
    eval_windows: int = setting(64, help="windows in the fixed validation subset used by periodic evals")


@dataclass(frozen=True)
class InnerConfig:
    """Each worker's AdamW: linear warm-up then cosine decay (sync: by the round; async: by the shard)."""

    # the paper's 4e-4 is for 150M models and 88k steps
    lr: float = setting(1e-3, flag="--inner-lr", help="peak inner AdamW learning rate")
    warmup_steps: int = 30
    min_lr_ratio: float = setting(0.1, help="cosine floor as a fraction of lr")
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = setting(1.0, help="max global gradient norm; 0 disables clipping")


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer applied to the averaged outer_grad (ALGORITHMS.md §1)."""

    # sgd with lr 1.0 and momentum 0 is FedAvg
    opt: str = setting("nesterov", flag="--outer-opt", choices=OUTER_OPTS, help="outer optimizer")
    lr: float = setting(0.7, flag="--outer-lr", help="outer lr (the paper's best; adam wants 0.1 or less)")
    momentum: float = setting(0.9, flag="--outer-momentum", help="outer momentum of nesterov and sgd")
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = setting(0.1, help="the paper: outer Adam needs eps around 0.1 to be stable")


@dataclass(frozen=True)
class SimConfig:
    """The simulator's virtual clock and how many processes compute workers (docs/async.md)."""

    speeds: tuple[float, ...] = setting(
        (),
        flag="--speeds",
        parse=_speeds,
        needs=ON_SIM,
        default_help="from --heterogeneity",
        help="seconds per inner step of each worker, e.g. 0.58,0.75,1.51,3.33",
    )
    heterogeneity: str = setting(
        "none", flag="--heterogeneity", choices=HETEROGENEITY, needs=ON_SIM, help="spread 1x, 1.5x, 3x, 6x"
    )
    speed_jitter: float = setting(
        0.0, flag="--speed-jitter", needs=ON_SIM, help="per-round jitter: step time × (1 + jitter·U[-1, 1])"
    )
    # END may be inf: from START to the end of the run
    slowdowns: tuple[str, ...] = setting(
        (),
        flag="--slowdown",
        needs=ON_SIM,
        default_help="none",
        help="W:FACTOR@START-END: worker W FACTOR× slower in [START, END) s, e.g. 2:4@100-200; repeatable",
    )
    bandwidth_mbps: float = setting(
        0.0, flag="--bandwidth-mbps", needs=ON_SIM, help="network Mbit/s of every pull and push; 0: unlimited"
    )
    latency_ms: float = setting(
        0.0, flag="--latency-ms", needs=ON_SIM, help="ms added to every pull and push"
    )
    # never changes a result: a run moved to --runtime collective drops it (cli._resumed_config)
    procs: int = setting(
        0, flag="--procs", needs=ON_SIM, help="processes computing workers, one thread each; 0: one per core"
    )


@dataclass(frozen=True)
class ServerConfig:
    """The asynchronous server (`--method async`): its update rule and how it hands out work."""

    rule: str = setting("dn", flag="--async-rule", choices=ASYNC_RULES, needs=ON_ASYNC, help="update rule")
    buffer: int = setting(0, flag="--dn-buffer", needs=ON_ASYNC, help="N for dn and buffer; 0: the workers")
    dn_c: float = setting(
        0.0, flag="--dn-c", needs=ON_ASYNC, help="c in [0, 1/N]: share of momentum on non-momentum arrivals"
    )
    poly_threshold: int = setting(
        10, flag="--poly-threshold", needs=ON_ASYNC, help="polythres drops updates staler than this"
    )
    delaycomp_lambda: float = setting(
        0.5, flag="--delaycomp-lambda", needs=ON_ASYNC, help="delay compensation λ"
    )
    # Algorithm 2 of the paper by default: DyLU, shard sampling and a grace period are all on.
    # DyLU: H_w = max(1, floor(v_w / max v · H)), v_w from measured speeds or (oracle) the true profile
    dylu: bool = setting(True, flag="--dylu", needs=ON_ASYNC, help="dynamic local updates")
    dylu_oracle: bool = setting(
        False, flag="--dylu-oracle", needs=ON_ASYNC, help="DyLU from the true speed profile"
    )
    dylu_alpha: float = setting(
        0.5, flag="--dylu-alpha", needs=ON_ASYNC, help="EMA weight of a new speed measurement"
    )
    shard_sampling: bool = setting(
        True, flag="--shard-sampling", needs=ON_ASYNC, help="shards by p_i ∝ max(|D_i|/Σ|D| − n_i/Σn, 0)"
    )
    grace_s: float | str = setting(
        "auto",
        flag="--grace-s",
        parse=_grace,
        needs=ON_ASYNC,
        help="s after an update in which other pushes sync too; auto: a tenth of a job; 0: off; inf: sync",
    )

    def __post_init__(self) -> None:
        if self.grace_s == math.inf:  # kept as text, so config.json (JSON has no infinity) holds it
            object.__setattr__(self, "grace_s", "inf")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `diloco train` with no flags runs exactly these defaults."""

    # single: one worker, plain AdamW; dp: data parallel
    method: str = setting("diloco", flag="--method", group="run", choices=METHODS, help="training method")
    num_workers: int = setting(4, flag="--workers", group="run", help="number of workers k")
    inner_steps: int = setting(50, flag="--inner-steps", group="run", help="inner steps per round H")
    rounds: int = setting(
        6, flag="--rounds", group="run", help="outer steps; each worker runs rounds × H inner steps"
    )
    seed: int = setting(0, flag="--seed", group="run", help="seed for initialisation, shards and batches")
    # DiLoCo's θ(0) is a pretrained model; the async paper's "matches sync" is measured fine-tuning
    init_from: str = setting(
        "",
        flag="--init-from",
        group="model",
        default_help="random, from --seed",
        help="start from these parameters: a finished run directory, a model.safetensors, or a "
        "save_pretrained folder (with --model-config) of the same model",
    )
    # benchmarks/overhead.py: on 2 cores 2 threads give 1.7x the tokens/s of 1 (results/overhead.json)
    threads: int = setting(
        0, flag="--threads", group="run", help="intra-op threads; 0: every core this process may use"
    )
    eval_every: int = setting(
        0, flag="--eval-every", group="output", help="inner steps between evals; 0: every round"
    )
    checkpoint_every: int = setting(
        0, flag="--checkpoint-every", group="output", help="rounds between checkpoints; 0: none"
    )
    keep_checkpoints: int = setting(
        3, flag="--keep-checkpoints", group="output", help="checkpoints kept, oldest removed"
    )
    on_nonfinite: str = setting(
        "stop",
        flag="--on-nonfinite",
        group="run",
        choices=ON_NONFINITE,
        help="on a worker's NaN/Inf loss or outer_grad: stop the run (exit code 3) or drop that outer_grad",
    )
    # what crosses the network (docs/communication.md)
    codec: str = setting(
        "fp32", flag="--codec", group="communication", choices=CODECS, help="how workers encode outer_grads"
    )
    topk_fraction: float = setting(
        0.01,
        flag="--topk-fraction",
        group="communication",
        needs=("codec", "topk"),
        help="fraction of each tensor's values topk sends",
    )
    error_feedback: bool = setting(
        False,
        flag="--error-feedback",
        group="communication",
        help="a worker adds what its earlier messages left out to its next outer_grad (lossy codecs)",
    )
    download_codec: str = setting(
        "fp32",
        flag="--download-codec",
        group="communication",
        choices=DOWNLOAD_CODECS,
        help="how workers download global parameters",
    )
    # Streaming DiLoCo (ALGORITHMS.md §3)
    fragments: int = setting(
        1,
        flag="--fragments",
        group="communication",
        needs=ON_DILOCO,
        help="strided fragments of blocks, synced at staggered steps",
    )
    overlap_steps: int = setting(
        0,
        flag="--overlap-steps",
        group="communication",
        needs=ON_DILOCO,
        help="inner steps a fragment's exchange runs under",
    )
    mix_alpha: float = setting(
        0.5,
        flag="--mix-alpha",
        group="communication",
        help="with overlap, a merged fragment is α·local + (1 − α)·global",
    )
    out: str = setting(
        "", flag="--out", group="output", help="run directory", default_help="runs/<method>-k<k>-H<H>-s<seed>"
    )
    target_loss: float = setting(
        0.0, flag="--target-loss", group="output", help="report reaching this val loss; 0: off"
    )
    # collective runs under torchrun (docs/distributed.md)
    runtime: str = setting("sim", flag="--runtime", group="run", choices=RUNTIMES, help="where workers run")
    procs_per_worker: int = setting(
        1,
        flag="--procs-per-worker",
        group="collective",
        needs=ON_COLLECTIVE,
        help="ranks per worker, data parallel on its shard",
    )
    bucket_mb: float = setting(
        25.0,
        flag="--bucket-mb",
        group="collective",
        needs=ON_COLLECTIVE,
        help="outer_grads are all-reduced in buckets of this many MB",
    )
    timeout_s: float = setting(
        300.0,
        flag="--timeout-s",
        group="collective",
        needs=ON_COLLECTIVE,
        help="seconds a rank waits in a collective or the store",
    )
    # the parameter server (`diloco serve`, docs/server.md)
    round_timeout_s: float = setting(
        0.0,
        flag="--round-timeout-s",
        group="parameter_server",
        needs=ON_SERVER,
        help="sync: seconds after a round starts when it closes without the late workers; 0: wait",
    )
    worker_timeout_s: float = setting(
        30.0,
        flag="--worker-timeout-s",
        group="parameter_server",
        needs=ON_SERVER,
        help="seconds without a heartbeat after which a worker is gone and its job is re-offered",
    )
    max_update_norm_ratio: float = setting(
        0.0,
        flag="--max-update-norm-ratio",
        group="parameter_server",
        needs=ON_SERVER,
        help="refuse an outer_grad whose norm per √step exceeds this × the median of recent ones; 0: off",
    )
    max_staleness: int = setting(
        0,
        flag="--max-staleness",
        group="parameter_server",
        needs=ON_SERVER,
        help="async: refuse an outer_grad pulled more than this many updates ago; 0: no limit",
    )
    drop_prob: float = setting(
        0.0,
        flag="--drop-prob",
        group="faults",
        needs=ON_DILOCO,
        help="probability that an outer_grad is lost, each round",
    )
    after_drop: str = setting(
        "own",
        flag="--after-drop",
        group="faults",
        choices=AFTER_DROP,
        needs=ON_DILOCO,
        help="where a worker whose outer_grad was lost (--drop-prob) starts its next round: own (its "
        "own parameters, as if it had not synchronised) or global (the global ones: its round is lost)",
    )
    workers_schedule: str = setting(
        "",
        flag="--workers-schedule",
        group="faults",
        needs=ON_DILOCO,
        default_help="all",
        help="active workers over training as FRACTION:WORKERS pairs, e.g. 0:4,0.5:8",
    )
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


def flag(path: str) -> str | None:
    """The `diloco train` flag of the setting at `path` ("sim.procs" -> "--procs"), or None."""
    return settings.find(TrainConfig, path).flag


def label(path: str) -> str:
    """How messages name the setting at `path`: "inner.lr (--inner-lr)", or "model.n_layer"."""
    return settings.label(TrainConfig, path)


# settings that simulate faults of sync DiLoCo: (setting, what it simulates)
SIMULATED_FAULTS = (("drop_prob", "lost outer_grads"), ("workers_schedule", "workers coming and going"))


def validate(cfg: TrainConfig) -> None:
    """Reject every setting that cannot run, naming the field and the fix: types and choices first
    (from the declarations), then ranges, then settings that do not apply to this run."""
    settings.check_types(cfg)
    settings.check_choices(cfg)
    positive = ("num_workers", "inner_steps", "rounds", "keep_checkpoints", "data.batch_size")
    for key in (*positive, "data.eval_windows", "procs_per_worker"):
        settings.at_least(cfg, key, minimum=1)
    for key in ("seed", "threads", "eval_every", "checkpoint_every", "inner.warmup_steps"):
        settings.at_least(cfg, key, minimum=0)
    if cfg.eval_every and cfg.method != "async" and cfg.eval_every % cfg.inner_steps:
        raise UserError(
            f"eval_every (--eval-every) must be a multiple of inner_steps ({cfg.inner_steps}), got "
            f"{cfg.eval_every}: the global model exists only between rounds; use 0 for every round."
        )
    if settings.changed(cfg, "keep_checkpoints") and not cfg.checkpoint_every:
        raise UserError(
            "keep_checkpoints (--keep-checkpoints) applies only with checkpoints; "
            "add --checkpoint-every N or drop it."
        )
    m = cfg.model
    settings.at_least(cfg, "model.vocab_size", minimum=256)
    for key in ("model.n_layer", "model.n_head", "model.d_model"):
        settings.at_least(cfg, key, minimum=1)
    settings.at_least(cfg, "model.seq_len", minimum=2)
    if m.seq_len > GPT_MAX_SEQ_LEN and not m.hf_config:
        raise UserError(
            f"model.seq_len (--seq-len) is {m.seq_len}, longer than diloco's GPT takes ({GPT_MAX_SEQ_LEN}); "
            f"use --seq-len {GPT_MAX_SEQ_LEN} or less, or a --model-config with that many positions."
        )
    if m.d_model % m.n_head:
        raise UserError(
            f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head}); change one of them."
        )
    settings.in_range(cfg, "data.val_fraction", lo=0.0, hi=0.5, lo_open=True)
    for key in ("inner.lr", "outer.lr", "outer.adam_eps", "bucket_mb", "timeout_s"):
        settings.in_range(cfg, key, lo=0.0, lo_open=True)
    for key in ("inner.weight_decay", "inner.grad_clip", "target_loss"):
        settings.in_range(cfg, key, lo=0.0)
    settings.in_range(cfg, "inner.min_lr_ratio", lo=0.0, hi=1.0)
    for key in ("inner.beta1", "inner.beta2", "outer.momentum", "outer.adam_beta1", "outer.adam_beta2"):
        settings.in_range(cfg, key, lo=0.0, hi=1.0, hi_open=True)
    settings.in_range(cfg, "drop_prob", lo=0.0, hi=1.0, hi_open=True)
    if cfg.workers_schedule:
        from diloco.core.membership import parse_workers_schedule

        try:
            parse_workers_schedule(cfg.workers_schedule, cfg.num_workers)
        except (ValueError, TypeError, AttributeError):
            raise UserError(
                f"workers_schedule (--workers-schedule) must be FRACTION:WORKERS pairs like "
                f"'0:4,0.5:8', starting at 0, fractions rising below 1, 1 to num_workers "
                f"({cfg.num_workers}) workers, got {cfg.workers_schedule!r}; fix it."
            ) from None
    _validate_data(cfg)
    if cfg.on_nonfinite == "drop" and cfg.method in ("single", "dp"):
        raise UserError(
            f"on_nonfinite (--on-nonfinite) drop needs outer_grads to drop; --method {cfg.method} has one "
            "model: use --on-nonfinite stop."
        )
    if cfg.runtime == "collective" and cfg.method != "diloco":
        raise UserError("the collective runtime runs --method diloco only; use --runtime sim for others.")
    if cfg.runtime == "server":
        if cfg.method not in ("diloco", "async"):
            raise UserError(
                f"the parameter server runs --method diloco or async, not {cfg.method}; use diloco train "
                "for the baselines."
            )
        for key, what in SIMULATED_FAULTS:
            if settings.changed(cfg, key):
                raise UserError(
                    f"{label(key)} simulates {what}, which the parameter server has for real (timeouts, "
                    "workers joining and leaving); drop it."
                )
        if cfg.server.dylu_oracle:
            raise UserError(
                "server.dylu_oracle (--dylu-oracle) reads the simulator's true speeds, which a real server "
                "does not have (it measures them); drop it."
            )
        if not cfg.checkpoint_every:
            raise UserError(
                "checkpoint_every (--checkpoint-every) must be at least 1 for the parameter server: its "
                "write-ahead log is cut at every checkpoint, and --resume starts from one."
            )
        settings.in_range(cfg, "round_timeout_s", lo=0.0)
        settings.in_range(cfg, "worker_timeout_s", lo=0.0, lo_open=True)
        settings.in_range(cfg, "max_update_norm_ratio", lo=0.0)
        settings.in_range(cfg, "max_staleness", lo=0)
        if cfg.max_staleness and cfg.method != "async":
            raise UserError(
                "max_staleness (--max-staleness) limits how stale an async push may be; a sync round's "
                "outer_grads are never stale: drop it or use --method async."
            )
        if 0 < cfg.max_update_norm_ratio <= 1:
            raise UserError(
                f"max_update_norm_ratio (--max-update-norm-ratio) is {cfg.max_update_norm_ratio:g}, which "
                "would refuse a typical update; give a number above 1 (10 in docs/server.md) or 0 for off."
            )
    _validate_communication(cfg)
    _validate_sim(cfg)
    _validate_server(cfg)
    settings.check_needs(cfg, {ON_SERVER: "diloco serve (docs/server.md)"})
    if settings.changed(cfg, "after_drop") and not cfg.drop_prob:
        raise UserError(
            f"after_drop (--after-drop) {cfg.after_drop} says what a dropped outer_grad's worker does, "
            "and no outer_grad is dropped: set drop_prob (--drop-prob) above 0, or leave after_drop out."
        )


def _validate_communication(cfg: TrainConfig) -> None:
    settings.in_range(cfg, "topk_fraction", lo=0.0, hi=1.0, lo_open=True)
    if cfg.error_feedback and cfg.codec == "fp32":
        raise UserError(
            "error_feedback (--error-feedback) keeps what a lossy codec leaves out, and fp32 leaves out "
            "nothing: add --codec bf16, int8, fp4 or topk, or drop it."
        )
    if cfg.error_feedback and cfg.method in ("single", "dp"):
        raise UserError(
            f"error_feedback (--error-feedback) needs outer_grads; --method {cfg.method} sends none."
        )
    for key in ("codec", "download_codec"):
        if settings.changed(cfg, key) and cfg.method in ("single", "dp"):
            raise UserError(
                f"{label(key)} encodes DiLoCo's messages; --method {cfg.method} sends none of them: drop it."
            )
    settings.at_least(cfg, "fragments", minimum=1)
    settings.at_least(cfg, "overlap_steps", minimum=0)
    settings.in_range(cfg, "mix_alpha", lo=0.0, hi=1.0, hi_open=True)  # 1: workers never see θ
    if settings.changed(cfg, "mix_alpha") and not cfg.overlap_steps:
        raise UserError(
            "mix_alpha (--mix-alpha) mixes a fragment that arrives after --overlap-steps steps; without "
            "overlap the fragment is replaced: add --overlap-steps N or drop it."
        )
    if cfg.fragments == 1 and not cfg.overlap_steps:
        return
    P, H, tau = cfg.fragments, cfg.inner_steps, cfg.overlap_steps
    if P > cfg.model.n_layer and not cfg.model.hf_config:  # a Hugging Face model's blocks: at build
        raise UserError(
            f"fragments (--fragments) is {P} but the model has {cfg.model.n_layer} blocks to split; "
            f"use at most {cfg.model.n_layer}."
        )
    if P > H:
        raise UserError(
            f"fragments (--fragments) {P} is more than inner_steps (--inner-steps) {H}, and each fragment "
            f"is sent at an inner step of its own: use --fragments {H} or fewer, or raise --inner-steps."
        )
    if H // P - tau < 1:
        raise UserError(
            f"overlap_steps (--overlap-steps) {tau} must be below inner_steps / fragments = {H // P} (each "
            f"fragment's exchange must finish before the next one starts): use --overlap-steps {H // P - 1} "
            "or fewer, or raise --inner-steps."
        )
    for key, why in SIMULATED_FAULTS:
        if settings.changed(cfg, key):
            raise UserError(
                f"Streaming DiLoCo (--fragments, --overlap-steps) does not simulate {why}: drop {label(key)}."
            )
    if cfg.on_nonfinite != "stop":
        raise UserError(
            "Streaming DiLoCo (--fragments, --overlap-steps) stops on a non-finite outer_grad: use "
            "--on-nonfinite stop."
        )
    if cfg.runtime == "server":
        raise UserError(
            "the parameter server hands out whole jobs and takes whole outer_grads, so Streaming DiLoCo "
            "(--fragments, --overlap-steps) runs on --runtime sim or collective only: drop them or change "
            "the runtime."
        )


def _validate_sim(cfg: TrainConfig) -> None:
    from diloco.runtime.clock import parse_slowdown

    s = cfg.sim
    settings.check(
        all(math.isfinite(v) and v > 0 for v in s.speeds),
        label("sim.speeds"),
        s.speeds,
        "a list of positive seconds per inner step, one per worker",
    )
    if s.speeds and len(s.speeds) != cfg.num_workers:
        raise UserError(
            f"sim.speeds (--speeds) gives {len(s.speeds)} speeds for {cfg.num_workers} workers; "
            "give one per worker."
        )
    settings.in_range(cfg, "sim.speed_jitter", lo=0.0, hi=0.99)
    settings.in_range(cfg, "sim.bandwidth_mbps", lo=0.0)
    settings.in_range(cfg, "sim.latency_ms", lo=0.0)
    settings.at_least(cfg, "sim.procs", minimum=0)
    for text in s.slowdowns:
        try:
            d = parse_slowdown(text)
            ok = 0 <= d.worker < cfg.num_workers and math.isfinite(d.factor) and d.factor > 0
            # END may be inf: slower from START to the end of the run
            ok = ok and math.isfinite(d.start_s) and 0 <= d.start_s < d.end_s
        except (ValueError, TypeError, AttributeError):
            ok = False
        want = "W:FACTOR@START-END with a valid worker, a finite FACTOR > 0 and START < END, e.g. 2:4@100-200"
        settings.check(ok, label("sim.slowdowns"), text, want)


def _validate_data(cfg: TrainConfig) -> None:
    from diloco.data.tokenizer import parse_spec

    d = cfg.data
    if not d.paths:
        for key in ("data.text_field", "data.source_field", "data.val_data"):
            if settings.changed(cfg, key):
                raise UserError(f"{label(key)} applies to your own text only; add --data PATH or drop it.")
    elif d.shards == "genre":
        raise UserError(
            "genre shards are the bundled corpus's genres; with --data use --shards by-source "
            "(each file, or each value of --source-field, a source)."
        )
    if d.val_data and settings.changed(cfg, "data.val_fraction"):
        raise UserError("--val-data and --val-fraction both choose the validation text; give one of them.")
    for key in ("data.paths", "data.val_data"):
        if any(not p for p in settings.get(cfg, key)):
            raise UserError(f"{label(key)} has an empty path; give the files or folders of your text.")
    parse_spec(d.tokenizer)  # bpe:N with a bad N is refused here
    if cfg.model.hf_config:  # diloco's GPT settings would be ignored
        gpt = [f"model.{k}" for k in ("name", "vocab_size", "n_layer", "n_head", "d_model")]
        if changed := [k for k in gpt if settings.changed(cfg, k)]:
            raise UserError(
                f"{label(changed[0])} is a setting of diloco's GPT, and --model-config chooses another "
                "model; drop it (set sizes in the model config)."
            )
    if d.source_field and d.shards != "by-source":
        raise UserError(
            f"{label('data.source_field')} names the sources of --shards by-source; add that or drop it."
        )


def _validate_server(cfg: TrainConfig) -> None:
    v = cfg.server
    settings.at_least(cfg, "server.buffer", minimum=0)
    settings.in_range(cfg, "server.dn_c", lo=0.0, hi=1.0 / (v.buffer or cfg.num_workers))
    settings.at_least(cfg, "server.poly_threshold", minimum=0)
    settings.in_range(cfg, "server.delaycomp_lambda", lo=0.0)
    settings.in_range(cfg, "server.dylu_alpha", lo=0.0, hi=1.0, lo_open=True)
    g = v.grace_s
    ok = g in ("auto", "inf") if isinstance(g, str) else not math.isnan(g) and g >= 0
    settings.check(ok, label("server.grace_s"), g, "auto or a number of seconds >= 0 (inf: wait for all)")


# the tables of a TOML file: model, data, inner, outer, sim, server
_SECTIONS = settings.sections(TrainConfig)


def _inline_model(values: dict[str, Any]) -> dict[str, Any]:
    """`model.hf_config` as the JSON text of the config it names; with `--init-from` a directory
    saved by save_pretrained and no model config, that directory's config (the model it holds)."""
    from diloco.model import hf

    model = values.get("model")
    model = dict(model) if isinstance(model, dict) else {}
    given = model.get("hf_config")
    init = values.get("init_from")
    if not given and isinstance(init, str) and init and hf.is_pretrained_dir(init):
        given = str(Path(init) / "config.json")
    if isinstance(given, str) and given:
        loaded = hf.load_model_config(given)  # JSON text too: refused here if it cannot be built
        if not given.lstrip().startswith("{"):
            model["hf_config"] = json.dumps(loaded, sort_keys=True)
            values = {**values, "model": model}
    return values


def from_dict(values: dict[str, Any], where: str = "the config") -> TrainConfig:
    """Build a config from nested dicts (a parsed TOML file, config.json, or CLI overrides).

    `model.name` picks a preset; the other model keys then override it.
    """
    values = _inline_model(settings.lists_to_tuples(TrainConfig, values))
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
        sections[key] = settings.build(cls, sub, f"[{key}] of {where}", base)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown := sorted(set(values) - known):
        raise UserError(
            f"unknown key {unknown[0]!r} in {where}; top-level keys are: "
            + ", ".join(sorted(known - set(_SECTIONS)))
            + f", and the tables [{'], ['.join(_SECTIONS)}]."
        )
    try:
        return TrainConfig(**values, **sections)
    except TypeError as e:  # a value of a type dataclasses cannot even hold
        raise UserError(f"bad value in {where}: {e}; fix that setting.") from None
