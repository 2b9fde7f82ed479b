"""Build a run's pieces from a TrainConfig: data, workers, clock, and the runtime object.

Everything a user can get wrong is checked here, before the run directory exists.

    python -c "from diloco.run.assemble import prepare_data; from diloco.config import TrainConfig; \
print(len(prepare_data(TrainConfig()).shards))"
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file

from diloco.config import InnerConfig, TrainConfig
from diloco.core.async_rules import AsyncRule
from diloco.core.inner import Worker
from diloco.core.lr import warmup_cosine
from diloco.core.outer import Fragmented, OuterOpt
from diloco.core.outer_side import OuterSide
from diloco.core.streaming import Schedule
from diloco.data.batches import ShardSampler, ShardSet, Windows, eval_windows
from diloco.data.shard_plan import ShardPlan, recorded_plan
from diloco.data.shards import make_shards, plan_shards
from diloco.data.text import (
    DATA_FILE,
    TOKENIZER_FILE,
    Text,
    bundled_text,
    eval_corpus,
    load_tokenizer,
    tokenised,
    training_pieces,
    user_text,
)
from diloco.data.tokenizer import Tokenizer
from diloco.data.tokens import Corpus, View
from diloco.errors import UserError
from diloco.model.gpt import GPT
from diloco.rundir import checkpoint
from diloco.runtime import faults
from diloco.runtime.async_sim import AsyncDiLoCo
from diloco.runtime.clock import Clock, parse_slowdown, profile
from diloco.runtime.pool import InlinePool, ProcessPool, balanced_assignment
from diloco.runtime.sim import DataParallel, DiLoCo, make_worker


@dataclass
class Data:
    shards: list[View]
    weights: list[float]
    eval_subset: Windows  # fixed windows for periodic evals
    eval_full: Windows  # the whole validation split
    tokenizer: Tokenizer
    corpus: Corpus  # the training text, tokenised
    record: dict  # fingerprints of the text it came from (RUN_DIR/data.json)
    plan: ShardPlan  # which units of the text each shard holds (RUN_DIR/shards.json)


def prepare_data(
    cfg: TrainConfig,
    *,
    run_dir: Path | None = None,
    progress: bool | None = None,
    plan: ShardPlan | None = None,
) -> Data:
    """The run's tokenizer (from `run_dir` when it holds one), tokens (cached), shards and
    validation windows. The shards are cut by `plan` (a server's), else by the one recorded in
    `run_dir`, else by a plan made now."""
    d = cfg.data
    text = training_text(cfg)
    record = data_record(cfg, text)
    if run_dir is not None:
        finished = (run_dir / "model.safetensors").is_file()
        check_data(
            run_dir,
            record,
            "train a new run on it (diloco train with another --out"
            + (f"; --init-from {run_dir} starts from this run's model)" if finished else ")"),
        )
    train = training_pieces(text, d.val_fraction, separate_val=bool(d.val_data))
    tokenizer = load_tokenizer(d, text, train, run_dir)
    corpus = training_corpus(cfg, tokenizer, progress, text=text, train=train)
    k = 1 if cfg.method == "single" else cfg.num_workers
    plan = plan or (recorded_plan(run_dir) if run_dir is not None else None)
    plan = plan or plan_shards(corpus, k, kind=d.shards, seed=cfg.seed, decode=tokenizer.decode)
    plan.check(d.shards, k, cfg.seed)
    shards, weights = cut_shards(cfg, corpus, plan)
    val = validation(cfg, tokenizer, progress, corpus=corpus)
    return Data(
        shards,
        weights,
        eval_windows(val, cfg.model.seq_len, d.eval_windows),
        eval_windows(val, cfg.model.seq_len),
        tokenizer,
        corpus,
        record,
        plan,
    )


def cut_shards(cfg: TrainConfig, corpus: Corpus, plan: ShardPlan) -> tuple[list[View], list[float]]:
    """The shards and their weights, cut by `plan`."""
    shards, weights = make_shards(corpus, plan)
    for i in range(len(shards)):
        sampler(cfg, shards, i)  # a shard too small for one batch is a UserError now, not later
    return shards, weights


def use_plan(cfg: TrainConfig, data: Data, plan: ShardPlan) -> Data:
    """`data` with its shards cut by `plan` (rank 0's, under torchrun) where its own differs."""
    if plan == data.plan:
        return data
    plan.check(cfg.data.shards, len(data.shards), cfg.seed)
    shards, weights = cut_shards(cfg, data.corpus, plan)
    return dataclasses.replace(data, shards=shards, weights=weights, plan=plan)


def small_shards(cfg: TrainConfig, data: Data) -> str | None:
    """A warning when shards hold fewer tokens than their worker reads in one round (H steps of
    batch_size × seq_len): those workers see the same text over and over, and their outer_grads
    get small weights (|D_i| / Σ|D_j|). None when every shard is large enough."""
    ranks = cfg.procs_per_worker if cfg.runtime == "collective" else 1
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


# Versions of the rules that cut a run's text, bumped when one changes what a run trains or
# validates on (data.json keeps those that apply; older runs are refused rather than changed).
RULES = {
    "val_split": 3,  # user data: whole documents by hash, tails when that holds out < ½ or > 2 × val_fraction
    # kmeans clusters ~4,096-token parts of documents (2), on one thread, ties of words broken by word (3)
    "kmeans_units": 3,
}


def data_record(cfg: TrainConfig, text: Text | None = None) -> dict:
    """Fingerprints of a run's training (and --val-data) text, and the versions of the rules
    that cut it where they apply, as RUN_DIR/data.json keeps them."""
    d = cfg.data
    record: dict = {"text": (text or training_text(cfg)).fingerprint}
    if d.val_data:
        record["val"] = user_text(d.val_data, text_field=d.text_field, source_field="").fingerprint
    applies = {"val_split": bool(d.paths and not d.val_data), "kmeans_units": d.shards == "kmeans"}
    if rules := {name: version for name, version in RULES.items() if applies[name]}:
        record["rules"] = rules
    return record


def check_data(run_dir: Path, record: dict, instead: str = "train a new run on it") -> None:
    """Refuse to resume or evaluate a run on text other than what it trained on, or cut by
    other rules (an older diloco's); `instead` is the step that works without the old text."""
    path = run_dir / DATA_FILE
    if not path.is_file():  # runs before this file: unchecked
        return
    saved = json.loads(path.read_text())
    if {k: v for k, v in saved.items() if k != "rules"} != {k: v for k, v in record.items() if k != "rules"}:
        raise UserError(
            f"the text of {run_dir} (its --data or --val-data files) is not what the run trained on: "
            f"a file changed, moved or was added; restore it, or {instead}."
        )
    if saved.get("rules", {}) != record.get("rules", {}):
        changed = sorted(set(saved.get("rules", {}).items()) ^ set(record.get("rules", {}).items()))
        raise UserError(
            f"{run_dir} was made by an older diloco that cut its text differently "
            f"({', '.join(sorted({name for name, _ in changed}))}); resume or evaluate it with that "
            f"version, or {instead}."
        )


def training_text(cfg: TrainConfig) -> Text:
    d = cfg.data
    return (
        user_text(d.paths, text_field=d.text_field, source_field=d.source_field)
        if d.paths
        else bundled_text()
    )


def training_corpus(
    cfg: TrainConfig, tokenizer: Tokenizer, progress: bool | None, *, text: Text | None = None, train=None
) -> Corpus:
    """The run's training text, tokenised (from the cache when it is there). `train` (the
    pieces of `text`, `training_pieces`) is given when the caller already made it."""
    d = cfg.data
    text = text or training_text(cfg)
    train = train or training_pieces(text, d.val_fraction, separate_val=bool(d.val_data))
    # a new way of holding documents out must not reuse an old cache entry
    split = {"val_fraction": d.val_fraction, "separate_val": bool(d.val_data), "rule": RULES["val_split"]}
    return tokenised(text, train, tokenizer, split, d, progress)


def validation(
    cfg: TrainConfig, tokenizer: Tokenizer, progress: bool | None, *, corpus: Corpus | None = None
) -> View:
    """The run's validation tokens: --val-data, or what its training text holds out."""
    d = cfg.data
    if d.val_data:
        val_text = user_text(d.val_data, text_field=d.text_field, source_field="")
        return eval_corpus(val_text, tokenizer, d, progress).split(True)
    return (corpus or training_corpus(cfg, tokenizer, progress)).split(True)


def sampler(cfg: TrainConfig, shards: list[View], i: int, batch_multiple: int = 1) -> ShardSampler:
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
        codec=cfg.communication.build_upload(),
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


def fit_model(cfg: TrainConfig, tokenizer: Tokenizer) -> TrainConfig:
    """`cfg` with a model that fits the tokenizer: diloco's GPT gets at least its vocabulary; a
    Hugging Face config must already have it, and positions for --seq-len."""
    vocab = tokenizer.vocab_size
    if not cfg.model.hf_config:
        return dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, vocab_size=max(cfg.model.vocab_size, vocab))
        )
    from diloco.model.hf import hf_config, load_model_config

    # transformers must build it (a UserError naming --model-config otherwise), with its defaults
    config = load_model_config(cfg.model.hf_config, where="the model config (--model-config)")
    spec = hf_config(config).get_text_config()
    if spec.vocab_size < vocab:
        raise UserError(
            f"the model config's vocab_size is {spec.vocab_size} but the tokenizer "
            f"({cfg.data.tokenizer}) has {vocab} tokens; raise vocab_size in the config to at least {vocab}, "
            "or use a smaller tokenizer."
        )
    positions = getattr(spec, "max_position_embeddings", None)  # GPT-2's n_positions too
    if positions is not None and positions < cfg.model.seq_len:
        raise UserError(
            f"the model config allows {positions} positions but --seq-len is {cfg.model.seq_len}; "
            f"use --seq-len {positions} or less."
        )
    blocks = getattr(spec, "num_hidden_layers", None)
    if blocks is not None and blocks < 1:
        raise UserError(
            f"the model config has {blocks} blocks (num_hidden_layers); set num_hidden_layers to 1 or more."
        )
    if blocks is not None and cfg.fragments > blocks:
        raise UserError(
            f"fragments (--fragments) is {cfg.fragments} but the model has {blocks} blocks; "
            f"use at most {blocks}."
        )
    return cfg


def build_model(cfg: TrainConfig) -> nn.Module:
    """The run's model, untrained: diloco's GPT, or the Hugging Face causal LM of --model-config."""
    if cfg.model.hf_config:
        from diloco.model.hf import HFCausalLM

        return HFCausalLM(json.loads(cfg.model.hf_config))
    return GPT(cfg.model)


def load_init(cfg: TrainConfig, tokenizer: Tokenizer | None = None) -> dict[str, torch.Tensor] | None:
    """The parameters `--init-from` names (a run directory's model.safetensors, that file, or a
    directory saved by save_pretrained), checked against the model `cfg` builds and, where that
    directory holds a tokenizer.json, against `tokenizer`; None without --init-from."""
    if not cfg.init_from:
        return None
    from diloco.model import hf

    path = Path(cfg.init_from)
    fix = (
        "give a finished run directory, a model.safetensors file, or a save_pretrained directory "
        "of the same model"
    )
    if hf.is_pretrained_dir(path):
        if not cfg.model.hf_config:
            raise UserError(
                f"--init-from {path} holds a Hugging Face model; give its config.json to --model-config too."
            )
        tensors = {f"model.{k}": v for k, v in hf.load_pretrained(path)[1].items()}
    else:
        if path.is_dir():
            if not (path / "model.safetensors").is_file():
                raise UserError(
                    f"--init-from {path} has no model.safetensors (has that run finished?); {fix}."
                )
            path = path / "model.safetensors"
        if not path.is_file():
            raise UserError(f"--init-from {path} does not exist; {fix}.")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise UserError(f"--init-from {path} is not a readable safetensors file ({e}); {fix}.") from None
    with torch.device("meta"):  # shapes only: nothing allocated
        model = build_model(cfg)
    tensors = checkpoint.with_tied(model, tensors)
    want = {k: v.shape for k, v in model.state_dict().items()}
    got = {k: v.shape for k, v in tensors.items()}
    vocab = (
        cfg.model.vocab_size if not cfg.model.hf_config else json.loads(cfg.model.hf_config).get("vocab_size")
    )
    for name in sorted(want.keys() & got.keys()):  # a vocabulary of another size: the likely cause
        there, here = got[name], want[name]
        if there != here and there[1:] == here[1:] and here[0] == vocab:
            raise UserError(
                f"--init-from {path} has a vocabulary of {there[0]} ({name}) but this run's tokenizer "
                f"and model have {here[0]}; use the tokenizer (--tokenizer) of the run it came from."
            )
    for name in sorted(want.keys() | got.keys()):
        if want.get(name) != got.get(name):
            there, here = got.get(name), want.get(name)
            shapes = (
                f"{tuple(there) if there is not None else 'missing'} there, "
                f"{tuple(here) if here is not None else 'absent'} here"
            )
            raise UserError(
                f"--init-from {path} does not fit this model: {name} is {shapes}; "
                "use the model settings (--model, --model-config) of the run it came from."
            )
    if tokenizer is None:
        return tensors
    known = check_init_tokenizer(path if path.is_dir() else path.parent, tokenizer)
    # diloco's GPT has the rows this tokenizer gives it (checked above); a Hugging Face model
    # learned its vocabulary's tokens, unknown here unless its folder names this tokenizer
    if cfg.model.hf_config and not known and model.vocab_size != tokenizer.vocab_size:
        raise UserError(
            f"--init-from {path} has a vocabulary of {model.vocab_size} but this run's tokenizer "
            f"({cfg.data.tokenizer}) has {tokenizer.vocab_size}, and its folder has no {TOKENIZER_FILE} "
            "to show they match; give --tokenizer the tokenizer.json the model was trained with."
        )
    return tensors


def check_init_tokenizer(folder: Path, tokenizer: Tokenizer) -> bool:
    """A model to start from was trained with the tokenizer its folder names (its tokenizer.json,
    or a diloco run's config.json saying byte): this run's tokenizer must give the same ids, or
    the model would read other tokens than it learned. Returns whether the folder names one."""
    from diloco.data.tokenizer import ByteTokenizer, load_tokenizer_file

    if (folder / TOKENIZER_FILE).is_file():
        theirs: Tokenizer = load_tokenizer_file(folder / TOKENIZER_FILE)
        why, use = f"its {TOKENIZER_FILE} splits text differently", folder / TOKENIZER_FILE
    elif _run_tokenizer(folder) == "byte":
        theirs, why, use = ByteTokenizer(), "bytes, its config.json says", "byte"
    else:
        return False
    probe = [PROBE_TEXT]
    if theirs.encode_batch(probe)[0].tolist() != tokenizer.encode_batch(probe)[0].tolist():
        raise UserError(
            f"--init-from {folder} was trained with another tokenizer ({why}); give --tokenizer {use}."
        )
    return True


def _run_tokenizer(folder: Path) -> str | None:
    """The --tokenizer of the diloco run in `folder` (from its config.json), if it is one."""
    try:
        data = json.loads((folder / "config.json").read_text()).get("data")
    except (OSError, ValueError, AttributeError):
        return None
    return data.get("tokenizer") if isinstance(data, dict) else None


# text every tokenizer must split the same way to be the same tokenizer (a sample, not a proof)
PROBE_TEXT = (
    "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    "  Tabs\tand   spaces, numbers 0123456789, punctuation !?;:'\"()[]{}<>-_=+*/\\|@#$%^&~`\n"
    "Unicode: café, naïve, Ærøskøbing, Ελληνικά, русский, 漢字, 日本語, 한국어, emoji 🙂🚀\n"
)


def initial_model(cfg: TrainConfig, init: dict[str, torch.Tensor] | None) -> nn.Module:
    """The global model at the start: from `cfg.seed`, then `init`'s parameters if given."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
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
        codec=cfg.communication.build_upload(),
        download=cfg.communication.build_download(),
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
    if cfg.runtime == "collective":
        from diloco.runtime.collective import CollectiveDiLoCo

        return CollectiveDiLoCo(cfg, data.shards, data.weights, build_worker=build_worker, init=init)
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
    if cfg.method == "diloco":
        return DiLoCo.from_side(
            side, pool, clock, inner_steps=cfg.inner_steps, schedule=streaming_schedule(cfg)
        )
    return AsyncDiLoCo.from_config(cfg, side, pool, clock, shard_sizes=[len(s) for s in data.shards])


def streaming_schedule(cfg: TrainConfig) -> Schedule | None:
    """Streaming DiLoCo's schedule (--fragments, --overlap-steps), or None for plain DiLoCo."""
    return cfg.streaming.build()


def outer_opt(cfg: TrainConfig) -> OuterOpt:
    """The sync outer optimizer: one, or one per fragment for Streaming DiLoCo."""
    if not cfg.streaming.on:
        return cfg.outer.build()
    return Fragmented([cfg.outer.build() for _ in range(cfg.fragments)])


def _async_rule(cfg: TrainConfig) -> AsyncRule:
    return cfg.async_.build(cfg.outer, cfg.num_workers)
