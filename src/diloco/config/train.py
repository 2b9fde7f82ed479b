"""TrainConfig: one training run's settings, the sections of diloco.config.sections and the
run-wide ones (method, workers, rounds, communication, runtimes, faults, output), validated on
construction (diloco.config.validate).

    python -c "from diloco.config.train import TrainConfig; print(TrainConfig(num_workers=8).run_dir)"
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco import settings
from diloco.config.sections import (
    CODECS,
    METHODS,
    ON_COLLECTIVE,
    ON_DILOCO,
    ON_SERVER,
    RUNTIMES,
    AsyncConfig,
    CommunicationConfig,
    DataConfig,
    DyluConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    SimConfig,
    StreamingConfig,
)
from diloco.config.validate import validate
from diloco.core.codec import DOWNLOAD_CODECS
from diloco.core.outer_side import AFTER_DROP, ON_NONFINITE
from diloco.settings import setting

# why Streaming DiLoCo is sync DiLoCo only (in every runtime)
STREAMING_NEEDS_ROUNDS = (
    "each fragment is synced at its own step of a round that every worker runs together, and "
    "asynchronous workers have no common rounds"
)


RUNTIME_HELP = "where workers run; server only by `diloco serve` (diloco train refuses it)"


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
        "save_pretrained folder of the same model (its config.json is the model's unless "
        "--model-config is given)",
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
        3,
        flag="--keep-checkpoints",
        group="output",
        needs=("checkpoint_every", ">", 0),
        because="without checkpoints there are none to keep",
        help="checkpoints kept, oldest removed",
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
    topk_chunk: int = setting(
        0,
        flag="--topk-chunk",
        group="communication",
        needs=("codec", "topk"),
        help="topk per chunk of this many values, offsets in log2 of it bits (SparseLoCo: 4096); "
        "0: per tensor, int32 indices",
    )
    topk_bits: int = setting(
        32,
        flag="--topk-bits",
        group="communication",
        needs=("codec", "topk"),
        help="bits of each value topk sends: 2 or 3 (a sign and levels between the chunk's smallest "
        "and largest kept magnitude), or 32 (float32)",
    )
    error_feedback: bool = setting(
        False,
        flag="--error-feedback",
        group="communication",
        needs=("codec", "!=", "fp32"),
        because="it keeps what a lossy codec leaves out, and fp32 leaves out nothing",
        help="a worker adds what its earlier messages left out to its next outer_grad (lossy codecs)",
    )
    ef_decay: float = setting(
        1.0,
        flag="--ef-decay",
        group="communication",
        needs=("error_feedback", True),
        help="what was left out decays by this factor each round before the next outer_grad joins it "
        "(SparseLoCo's β; 1: kept whole)",
    )
    download_codec: str = setting(
        "fp32",
        flag="--download-codec",
        group="communication",
        choices=DOWNLOAD_CODECS,
        help="how workers download global parameters",
    )
    # Streaming DiLoCo (docs/method.md §3)
    fragments: int = setting(
        1,
        flag="--fragments",
        group="communication",
        needs=ON_DILOCO,
        because=STREAMING_NEEDS_ROUNDS,
        help="strided fragments of blocks, synced at staggered steps",
    )
    overlap_steps: int = setting(
        0,
        flag="--overlap-steps",
        group="communication",
        needs=ON_DILOCO,
        because=STREAMING_NEEDS_ROUNDS,
        help="inner steps a fragment's exchange runs under",
    )
    mix_alpha: float = setting(
        0.5,
        flag="--mix-alpha",
        group="communication",
        needs=("overlap_steps", ">", 0),
        because="it mixes a fragment that arrives late, and without overlap a fragment is replaced",
        help="with overlap, a merged fragment is α·local + (1 − α)·global",
    )
    out: str = setting(
        "", flag="--out", group="output", help="run directory", default_help="runs/<method>-k<k>-H<H>-s<seed>"
    )
    target_loss: float = setting(
        0.0, flag="--target-loss", group="output", help="report reaching this val loss; 0: off"
    )
    # collective runs under torchrun (docs/distributed.md)
    runtime: str = setting("sim", flag="--runtime", group="run", choices=RUNTIMES, help=RUNTIME_HELP)
    procs_per_worker: int = setting(
        1,
        flag="--procs-per-worker",
        group="collective",
        needs=("runtime", "in", ("collective", "server")),
        help="ranks per worker, data parallel on its shard (a worker's batch is this × --batch-size; "
        "diloco serve: a torchrun group of any size that divides it)",
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
    max_inflight_pushes: int = setting(
        0,
        flag="--max-inflight-pushes",
        group="parameter_server",
        needs=ON_SERVER,
        help="pushes received and checked at once (each read in place while checked); the rest wait; "
        "0: as many as a quarter of the memory available at start holds",
    )
    max_inflight_downloads: int = setting(
        1,
        flag="--max-inflight-downloads",
        group="parameter_server",
        needs=ON_SERVER,
        help="async: θ versions held for downloads at once (a copy of θ each); a job waits for one; "
        "raise it on slow links, where each worker's link, not the server, bounds its download",
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
        needs=(ON_DILOCO, ("drop_prob", ">", 0)),
        because="it says what a dropped outer_grad's worker does",
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
    # the async rule's settings: the TOML table [async], config.json's "async" (once "server")
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    dylu: DyluConfig = field(default_factory=DyluConfig)  # [dylu]: async.dylu* until issue 31

    def __post_init__(self) -> None:
        validate(self)

    @property
    def streaming(self) -> StreamingConfig:
        """Streaming DiLoCo's settings; `.build()` is the schedule, or None for plain DiLoCo."""
        return _view(StreamingConfig, self)

    @property
    def communication(self) -> CommunicationConfig:
        """The codecs' settings; `.build_upload()` and `.build_download()` are the codecs."""
        return _view(CommunicationConfig, self)

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
        """The nested dict config.json holds, by key (the async section as "async")."""
        return {settings.key(k): v for k, v in dataclasses.asdict(self).items()}


def flag(path: str) -> str | None:
    """The `diloco train` flag of the setting at `path` ("sim.procs" -> "--procs"), or None."""
    return settings.find(TrainConfig, path).flag


def label(path: str) -> str:
    """How messages name the setting at `path`: "inner.lr (--inner-lr)", or "model.n_layer"."""
    return settings.label(TrainConfig, path)


def _view(cls: type, cfg: TrainConfig) -> Any:
    """A section that views TrainConfig's flat fields, filled by name (no default written twice)."""
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})
