"""The data recipe of a run: from its TrainConfig to the tokenizer, the tokenised training text,
the shards (cut by the run's shard plan) and the validation windows, and the fingerprints that
tie a run directory to the text it trained on.

    python -c "from diloco.data.recipe import prepare_data; from diloco.config import TrainConfig; \
print(len(prepare_data(TrainConfig()).shards))"
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from diloco.config import TrainConfig
from diloco.data.batches import ShardSampler, Windows, eval_windows
from diloco.data.shard_plan import ShardPlan, recorded_plan
from diloco.data.shards import make_shards, plan_shards
from diloco.data.text import (
    DATA_FILE,
    Text,
    bundled_text,
    eval_corpus,
    load_tokenizer,
    tokenised,
    training_pieces,
    user_text,
)
from diloco.data.tokenizer import Tokenizer
from diloco.data.tokens import TUNE, VAL, Corpus, View
from diloco.errors import UserError


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
    train = training_pieces(
        text, d.val_fraction, separate_val=bool(d.val_data), tune_fraction=d.tune_fraction
    )
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
    train = train or training_pieces(
        text, d.val_fraction, separate_val=bool(d.val_data), tune_fraction=d.tune_fraction
    )
    # a new way of holding documents out must not reuse an old cache entry
    split = {"val_fraction": d.val_fraction, "separate_val": bool(d.val_data), "rule": RULES["val_split"]}
    if d.tune_fraction:  # none: the key it always had
        split["tune_fraction"] = d.tune_fraction
    return tokenised(text, train, tokenizer, split, d, progress)


def validation(
    cfg: TrainConfig, tokenizer: Tokenizer, progress: bool | None, *, corpus: Corpus | None = None
) -> View:
    """The run's validation tokens: --val-data, or what its training text holds out; with
    `--eval-on tune`, the tuning split its training text holds out."""
    d = cfg.data
    if d.eval_on == "tune":
        return (corpus or training_corpus(cfg, tokenizer, progress)).split(TUNE)
    if d.val_data:
        val_text = user_text(d.val_data, text_field=d.text_field, source_field="")
        return eval_corpus(val_text, tokenizer, d, progress).split(VAL)
    return (corpus or training_corpus(cfg, tokenizer, progress)).split(VAL)


def sampler(cfg: TrainConfig, shards: list[View], i: int, batch_multiple: int = 1) -> ShardSampler:
    """The batches of shard i, seeded by the run's seed and i (`batch_multiple` × batch_size rows)."""
    return ShardSampler(
        shards[i],
        batch_size=cfg.data.batch_size * batch_multiple,
        seq_len=cfg.model.seq_len,
        seed=cfg.seed * 1_000_003 + i,
    )
