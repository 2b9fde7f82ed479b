"""The settings of each component as one frozen dataclass per section (the TOML tables), and the
choices, presets and help groups they declare; each section builds its component.

    python -c "from diloco.config.sections import OuterConfig; print(OuterConfig(opt='sgd').build())"
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.config.parsers import parse_speeds
from diloco.core.async_policy import DYLU_BY
from diloco.core.async_rules import ASYNC_RULES, AsyncRule, build_async_rule
from diloco.core.codec import CODECS as _CODECS
from diloco.core.codec import Codec, build_codec
from diloco.core.outer import OUTER_OPT_HELP, OUTER_OPTS, OuterOpt, build_outer_opt
from diloco.core.streaming import Schedule
from diloco.settings import setting

METHODS = ("diloco", "async", "single", "dp")
RUNTIMES = ("sim", "collective", "server")  # server: `diloco serve` (docs/server.md)
# --heterogeneity: each level's spread (slowest ÷ fastest seconds per step; runtime.clock.profile)
HETEROGENEITY = {"none": 1.0, "slight": 1.5, "moderate": 3.0, "very": 6.0}
SHARDINGS = ("iid", "genre", "kmeans", "by-source")
CODECS = tuple(_CODECS)  # the names of core.codec's codecs

PRESETS = ("nano", "micro", "20m", "60m", "150m", "1b", "10b")  # MODEL_PRESETS' keys (below)
# `needs` of settings that apply to one runtime or method only (the simulator's clock: not real time)
ON_SIM, ON_COLLECTIVE, ON_SERVER = ("runtime", "sim"), ("runtime", "collective"), ("runtime", "server")
ON_SIM_OR_COLLECTIVE = ("runtime", "in", ("sim", "collective"))  # emulated devices (runtime/clock.py)
ON_ASYNC, ON_DILOCO = ("method", "async"), ("method", "diloco")
ON_DYLU_METHODS = ("method", "in", ("async", "diloco"))  # DyLU: async jobs, or sync rounds
# The groups of `diloco train --help`, in order, by the name a top-level setting gives with `group=`
# (each must give one: tests/unit/test_cli_flags.py). A section's settings are in the section's
# group ("" here: titled by the section's docstring) unless they name another.
MAX_THREADS = 1024  # --threads: torch takes a C int; more than this is a typo, not a machine

FLAG_GROUPS = {
    "run": "the run (method, workers, rounds, seed, runtime)",
    "model": "",
    "data": "",
    "inner": "",
    "outer": "",
    "communication": "compression and Streaming DiLoCo (docs/communication.md)",
    "async": "",
    "dylu": "",
    "sim": "",
    "faults": "faults simulated in sync DiLoCo (the parameter server has real ones)",
    "collective": "the collective runtime (--runtime collective under torchrun, docs/distributed.md)",
    "parameter_server": "the parameter server (diloco serve only, docs/server.md)",
    "output": "checkpoints, evaluation and output",
}


def _grace(text: str) -> float | str:
    """--grace-s: a number of seconds, `auto`, `measured` or `inf`."""
    return text if text in ("auto", "measured", "inf") else float(text)


def _speeds(text: str) -> tuple[float, ...]:
    """--speeds: comma-separated seconds per step."""
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
    vocab_size: int = setting(
        256, help="vocabulary rows of diloco's GPT (at least the tokenizer's)", default_help="the preset's"
    )
    # `model.name` picks a preset; these keys, given in a config file, override its sizes
    n_layer: int = setting(4, help="transformer blocks", default_help="the preset's")
    n_head: int = setting(4, help="attention heads (divides d_model)", default_help="the preset's")
    d_model: int = setting(96, help="width of the residual stream", default_help="the preset's")
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
    # the Streaming DiLoCo paper's 1B (24 blocks) and 10B (48 blocks) sizes, for `diloco plan`
    # (built on the meta device there) and for machines that can hold them
    "1b": ModelConfig(name="1b", vocab_size=32_000, n_layer=24, n_head=14, d_model=1792, seq_len=1024),
    "10b": ModelConfig(name="10b", vocab_size=32_000, n_layer=48, n_head=32, d_model=4096, seq_len=2048),
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
    # a tuning split: pick hyperparameters on text that is neither trained on nor reported
    tune_fraction: float = setting(
        0.0, flag="--tune-fraction", help="held out of training for tuning: the end of every training text"
    )
    eval_on: str = setting("val", flag="--eval-on", choices=("val", "tune"), help="the split evals score")
    eval_windows: int = setting(64, help="windows in the fixed validation subset used by periodic evals")


@dataclass(frozen=True)
class InnerConfig:
    """Each worker's AdamW: linear warm-up then cosine decay (sync: by the round; async: by the shard)."""

    # the paper's 4e-4 is for 150M models and 88k steps
    lr: float = setting(1e-3, flag="--inner-lr", help="peak inner AdamW learning rate")
    warmup_steps: int = setting(30, flag="--warmup-steps", help="linear warm-up steps of the inner lr")
    min_lr_ratio: float = setting(0.1, help="cosine floor as a fraction of lr")
    weight_decay: float = setting(0.1, help="AdamW's decoupled weight decay")
    beta1: float = setting(0.9, help="AdamW's β1")
    beta2: float = setting(0.95, help="AdamW's β2")
    grad_clip: float = setting(1.0, help="max global gradient norm; 0 disables clipping")


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer applied to the averaged outer_grad (docs/method.md §1)."""

    # sgd with lr 1.0 and momentum 0 is FedAvg
    opt: str = setting("nesterov", flag="--outer-opt", choices=OUTER_OPTS, help=OUTER_OPT_HELP)
    lr: float = setting(0.7, flag="--outer-lr", help="outer lr (the paper's best; adam wants 0.1 or less)")
    momentum: float = setting(0.9, flag="--outer-momentum", help="outer momentum of nesterov and sgd")
    adam_beta1: float = setting(0.9, help="the outer Adam's β1 (--outer-opt adam)")
    adam_beta2: float = setting(0.999, help="the outer Adam's β2 (--outer-opt adam)")
    adam_eps: float = setting(0.1, help="the paper: outer Adam needs eps around 0.1 to be stable")

    def build(self) -> OuterOpt:
        """The outer optimizer these settings describe (core.outer)."""
        return build_outer_opt(
            self.opt,
            lr=self.lr,
            momentum=self.momentum,
            betas=(self.adam_beta1, self.adam_beta2),
            eps=self.adam_eps,
        )


@dataclass(frozen=True)
class SimConfig:
    """The simulator's virtual clock and how many processes compute workers (docs/async.md)."""

    speeds: tuple[float, ...] = setting(
        (),
        flag="--speeds",
        parse=_speeds,
        needs=ON_SIM_OR_COLLECTIVE,
        because="a server's worker is slowed by its own `diloco worker --slowdown F`",
        default_help="from --heterogeneity",
        help="seconds per inner step of each worker, e.g. 0.58,0.75,1.51,3.33 (under torchrun: each step "
        "padded to at least that, an emulated device)",
    )
    heterogeneity: str = setting(
        "none",
        flag="--heterogeneity",
        choices=tuple(HETEROGENEITY),
        needs=ON_SIM,
        help="spread 1x, 1.5x, 3x, 6x",
    )
    speed_jitter: float = setting(
        0.0, flag="--speed-jitter", needs=ON_SIM, help="per-round jitter: step time × (1 + jitter·U[-1, 1])"
    )
    # END may be inf: from START to the end of the run
    slowdowns: tuple[str, ...] = setting(
        (),
        flag="--slowdown",
        needs=ON_SIM_OR_COLLECTIVE,
        because="a server's worker is slowed by its own `diloco worker --slowdown F`",
        default_help="none",
        help="W:FACTOR@START-END: worker W FACTOR× slower in [START, END) s, e.g. 2:4@100-200 (under "
        "torchrun: wall seconds from the first round, each inner step padded); repeatable",
    )
    bandwidth_mbps: float = setting(
        0.0, flag="--bandwidth-mbps", needs=ON_SIM, help="network Mbit/s of every pull and push; 0: unlimited"
    )
    latency_ms: float = setting(
        0.0, flag="--latency-ms", needs=ON_SIM, help="ms added to every pull and push"
    )
    # never changes a result: a run moved to --runtime collective drops it (cli.configure.resumed_config)
    procs: int = setting(
        0, flag="--procs", needs=ON_SIM, help="processes computing workers, one thread each; 0: one per core"
    )


@dataclass(frozen=True)
class AsyncConfig:
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
    # Algorithm 2 of the paper by default: DyLU ([dylu]), shard sampling and a grace period are all on.
    shard_sampling: bool = setting(
        True, flag="--shard-sampling", needs=ON_ASYNC, help="shards by p_i ∝ max(|D_i|/Σ|D| − n_i/Σn, 0)"
    )
    grace_s: float | str = setting(
        "auto",
        flag="--grace-s",
        parse=_grace,
        needs=ON_ASYNC,
        help="s after an update in which other pushes sync too; auto: a tenth of a job; measured: the "
        "spread of recent arrivals around when they were due (simulator); 0: off; inf: sync",
    )

    def __post_init__(self) -> None:
        if self.grace_s == math.inf:  # kept as text, so config.json (JSON has no infinity) holds it
            object.__setattr__(self, "grace_s", "inf")

    def build(self, outer: OuterConfig, num_workers: int, *, at_group_end: bool = False) -> AsyncRule:
        """The async rule these settings describe (core.async_rules), with the outer lr and
        momentum of `outer`; N of dn and buffer is `num_workers` unless `buffer` says;
        `at_group_end`: DN's momentum step at a grace group's end (with jobs as deadlines)."""
        return build_async_rule(
            self.rule,
            lr=outer.lr,
            momentum=outer.momentum,
            num_workers=num_workers,
            buffer=self.buffer,
            c=self.dn_c,
            poly_threshold=self.poly_threshold,
            delaycomp_lambda=self.delaycomp_lambda,
            at_group_end=at_group_end,
        )


@dataclass(frozen=True)
class DyluConfig:
    """Dynamic local updates: each worker's share of a job from its measured speed (docs/method.md §2)."""

    # None: the method's default, on for async (Algorithm 2), off for diloco (plain sync DiLoCo)
    enabled: bool | None = setting(
        None,
        flag="--dylu",
        needs=ON_DYLU_METHODS,
        default_help="on with --method async, off with diloco",
        help="dynamic local updates: a slower worker takes fewer inner steps (async: per job; diloco: "
        "per round, and every worker syncs together)",
    )
    by: str = setting(
        "auto",
        flag="--dylu-by",
        choices=DYLU_BY,
        needs=ON_DYLU_METHODS,
        help="steps: a job is H_w = ⌊v_w / max v · H⌋ steps (the paper); time: a job is a deadline of H × "
        "the fastest measured seconds per step, and its worker trains until it (at least one step); "
        "auto: time for async, steps for diloco",
    )
    alpha: float = setting(
        0.5,
        flag="--dylu-alpha",
        needs=ON_DYLU_METHODS,
        help="EMA weight of a new speed measurement",
    )
    oracle: bool = setting(
        False,
        flag="--dylu-oracle",
        needs=(ON_DYLU_METHODS, ON_SIM),
        because="it reads the simulator's true speeds, which a real runtime does not have (it measures them)",
        help="DyLU from the simulator's true speed profile, not measured speeds",
    )

    def on(self, method: str) -> bool:
        """Whether DyLU is on for a run of `method` (`enabled` None: on for async only)."""
        return (method == "async") if self.enabled is None else self.enabled

    def by_for(self, method: str) -> str:
        """How DyLU sizes a job in a run of `method`: `by`, where "auto" is time for async (jobs as
        deadlines keep grace groups whole when speeds wander, docs/async.md) and steps for diloco."""
        if self.by != "auto":
            return self.by
        return "time" if method == "async" else "steps"


@dataclass(frozen=True)
class StreamingConfig:
    """Streaming DiLoCo's settings (docs/method.md §3), read from TrainConfig's flat fields
    (`TrainConfig.streaming`): config.json keeps them at its top level. A view: the settings, their
    defaults and flags are declared on TrainConfig, whose fields of these names fill it."""

    inner_steps: int
    fragments: int
    overlap_steps: int
    mix_alpha: float

    @property
    def on(self) -> bool:
        """Whether the run is Streaming DiLoCo (more than one fragment, or overlap)."""
        return self.fragments != 1 or self.overlap_steps != 0

    def build(self) -> Schedule | None:
        """The schedule of a round (core.streaming), or None for plain DiLoCo. A UserError for
        fragments and overlap that do not fit in the round."""
        if not self.on:
            return None
        return Schedule(self.inner_steps, self.fragments, self.overlap_steps, self.mix_alpha)


@dataclass(frozen=True)
class CommunicationConfig:
    """What crosses the network (docs/communication.md), read from TrainConfig's flat fields
    (`TrainConfig.communication`): config.json keeps them at its top level. A view, as
    StreamingConfig is."""

    codec: str
    topk_fraction: float
    topk_chunk: int
    topk_bits: int
    error_feedback: bool
    ef_decay: float
    download_codec: str

    def build_upload(self) -> Codec:
        """The codec workers encode outer_grads with (--codec, --error-feedback, --topk-*)."""
        return build_codec(
            self.codec,
            error_feedback=self.error_feedback,
            ef_decay=self.ef_decay,
            topk_fraction=self.topk_fraction,
            topk_chunk=self.topk_chunk,
            topk_bits=self.topk_bits,
        )

    def build_download(self) -> Codec:
        """The codec global parameters are downloaded through (--download-codec)."""
        return build_codec(self.download_codec)
