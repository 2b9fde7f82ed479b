"""Training on a user's own text (`diloco train --data`): how fast it is tokenised, how fast a
second run finds it in the cache, and whether training from its memory-mapped tokens is as fast
and as small as training on the bundled Shakespeare. Prints one JSON object; a full run also
saves it as benchmarks/results/data_pipeline.json (`--out FILE` elsewhere; a --quick run saves
nothing unless given --out).

    python benchmarks/data_pipeline.py              # a 100 MB corpus: ~6 minutes on 2 cores
    python benchmarks/data_pipeline.py --quick      # an 8 MB corpus, few rounds: ~1.5 minutes
    python benchmarks/data_pipeline.py --workdir /tmp/dp --keep   # keep (and reuse) the corpus

1. A corpus of `--mb` MB (MB = 2^20 bytes throughout) is generated deterministically (`--seed`)
   in a temporary folder: documents of 2-20 KB, each made of paragraphs of the bundled works
   drawn at random, written to 8 files (`--formats`, cycled over the files; default all jsonl,
   `{"text": ...}` per line).
2. Tokenisation, cache miss (a fresh cache folder each): `prepare_data` of the `--data` config
   with `--tokenizer byte`, and with `bpe:4096`, whose BPE training (`load_tokenizer`) is timed
   apart from the `prepare_data` that then encodes; MB/s of input files. `read_mb_per_s` is
   parsing alone (`sources.read_documents`), `fingerprint_s` hashing the input files (done by
   every `prepare_data`, cached or not). Then the second `prepare_data` (cache hit), seconds.
   `peak_rss_mb_tokenise_*`, `peak_rss_mb_bpe_train`: this process's peak RSS during each
   (VmHWM, reset before each; it includes torch and what the process already holds).
3. Training tokens/s, one process: the nano model, byte tokenizer (so both models are the same),
   k=4 DiLoCo workers, H=10, batch 16 x 128, `--procs 1`, 1 intra-op thread (the simulator's
   workers always compute with one; `threads` in the output), on the bundled corpus and on the
   generated one. Only `trainer.round()` is timed (no data preparation, no evaluation); the two
   trainers alternate A B, B A, ... for `--repeats` pairs and `tokens_per_s_ratio` is the
   median of the per-pair ratios user/bundled. Target: >= 0.98 (data is never the bottleneck).
   `batch_us_*` is the time to draw one batch from a shard (`ShardSampler`), for scale.
4. Peak RSS: each training again in a child process (this script, `--child`), cache warm, for
   `--child-rounds` rounds; the child's VmHWM (not ru_maxrss, which Linux carries over from
   the parent through fork and exec), which includes Python and torch (`rss_baseline_mb_*`:
   after the imports, before any data). Target: user/bundled < 2.
   `cache_hit_s_fresh_*` is the child's `prepare_data`, a cache hit in a new process.

The corpus and caches are removed at exit unless `--keep`; with `--keep` and `--workdir`, a
later run reuses a corpus made with the same `--mb`, `--seed` and `--formats` (caches are always
rebuilt, so tokenisation is always a cache miss).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from diloco.config import DataConfig, SimConfig, TrainConfig
from diloco.data.batches import ShardSampler
from diloco.data.recipe import prepare_data, training_text
from diloco.data.sources import read_documents
from diloco.data.text import load_corpus, load_tokenizer, training_pieces
from diloco.model.init import fit_model
from diloco.run.assemble import build_trainer
from diloco.run.threads import set_threads

MB = 1 << 20
FILES = 8
DOC_BYTES = (2_000, 20_000)
WORKERS, H, BATCH, SEQ = 4, 10, 16, 128
THREADS = 1  # what InlinePool gives every worker's job, whatever --threads says
BPE = "bpe:4096"
TARGET_TOKENS_RATIO = 0.98
TARGET_RSS_RATIO = 2.0


# --- the corpus ----------------------------------------------------------------------------------


def paragraphs() -> list[str]:
    out = []
    for work in load_corpus():
        out += [p.strip("\n") for p in work.text.decode().split("\n\n") if p.strip()]
    return out


def generate(folder: Path, mb: float, seed: int, formats: list[str]) -> dict:
    """Writes FILES files of documents (2-20 KB of random paragraphs) totalling `mb` MB of text."""
    rng = random.Random(seed)
    paras = paragraphs()
    folder.mkdir(parents=True)
    per_file = mb * MB / FILES
    documents = text_bytes = 0
    for f in range(FILES):
        kind = formats[f % len(formats)]
        docs, size = [], 0
        while size < per_file:
            target, doc, n = rng.randint(*DOC_BYTES), [], 0
            while n < target:
                doc.append(rng.choice(paras))
                n += len(doc[-1].encode()) + 2
            docs.append("\n\n".join(doc))
            size += n - 2
        _write(folder / f"part-{f:02d}.{kind}", kind, docs)
        documents += 1 if kind == "txt" else len(docs)
        text_bytes += size
    files = sorted(folder.iterdir())
    return {
        "corpus_mb": round(sum(p.stat().st_size for p in files) / MB, 2),
        "text_mb": round(text_bytes / MB, 2),
        "documents": documents,
        "files": len(files),
        "formats": sorted({p.suffix[1:] for p in files}),
    }


def _write(path: Path, kind: str, docs: list[str]) -> None:
    if kind == "jsonl":
        with open(path, "w", encoding="utf-8") as out:
            for d in docs:
                out.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    elif kind == "csv":
        with open(path, "w", encoding="utf-8", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["text"])
            writer.writerows([d] for d in docs)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), path)
    elif kind == "txt":  # the whole file is one document
        path.write_text("\n\n".join(docs), encoding="utf-8")
    else:
        raise ValueError(kind)


# --- configs -------------------------------------------------------------------------------------


def config(cache: Path, data: Path | None = None, tokenizer: str = "byte", rounds: int = 100) -> TrainConfig:
    return TrainConfig(
        method="diloco",
        num_workers=WORKERS,
        inner_steps=H,
        rounds=rounds,
        threads=THREADS,
        sim=SimConfig(procs=1),
        data=DataConfig(
            paths=(str(data),) if data else (), tokenizer=tokenizer, cache_dir=str(cache), batch_size=BATCH
        ),
    )


def trainer_for(cfg: TrainConfig):
    data = prepare_data(cfg, progress=False)
    return build_trainer(fit_model(cfg, data.tokenizer), data), data


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def _reset_peak_rss() -> None:
    """Resets this process's VmHWM to its current RSS (Linux 4.0+), so a phase's peak can be read."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --- 2. tokenisation -----------------------------------------------------------------------------


def measure_tokenise(corpus: Path, work: Path, corpus_mb: float) -> dict:
    n_docs, read_s = timed(lambda: sum(1 for _ in read_documents([corpus])))
    cfg = config(work / "cache-byte", corpus)
    _, fingerprint_s = timed(training_text, cfg)
    _reset_peak_rss()
    byte, byte_s = timed(prepare_data, cfg, progress=False)
    byte_peak = _rss_mb("VmHWM")
    _, hit_s = timed(prepare_data, cfg, progress=False)

    cfg_bpe = config(work / "cache-bpe", corpus, tokenizer=BPE)
    text = training_text(cfg_bpe)
    train = training_pieces(text, cfg_bpe.data.val_fraction, separate_val=False)
    _reset_peak_rss()
    _, bpe_train_s = timed(load_tokenizer, cfg_bpe.data, text, train, None)
    bpe_train_peak = _rss_mb("VmHWM")
    _reset_peak_rss()
    bpe, bpe_s = timed(prepare_data, cfg_bpe, progress=False)  # loads the trained tokenizer, encodes
    bpe_peak = _rss_mb("VmHWM")
    _, bpe_hit_s = timed(prepare_data, cfg_bpe, progress=False)
    byte_tokens, bpe_tokens = byte.corpus.meta["tokens"], bpe.corpus.meta["tokens"]
    return {
        "read_mb_per_s": round(corpus_mb / read_s, 1),
        "read_documents": n_docs,
        "fingerprint_s": round(fingerprint_s, 3),
        "tokenise_byte_s": round(byte_s, 2),
        "tokenise_byte_mb_per_s": round(corpus_mb / byte_s, 1),
        "bpe_train_s": round(bpe_train_s, 2),
        "tokenise_bpe_s": round(bpe_s, 2),
        "tokenise_bpe_mb_per_s": round(corpus_mb / bpe_s, 1),
        "bpe_total_mb_per_s": round(corpus_mb / (bpe_train_s + bpe_s), 2),
        "cache_hit_s": round(hit_s, 3),
        "cache_hit_bpe_s": round(bpe_hit_s, 3),
        "byte_tokens": byte_tokens,
        "bpe_tokens": bpe_tokens,
        "bpe_bytes_per_token": round(byte_tokens / bpe_tokens, 3),
        # this process's peak during each cache miss (VmHWM reset before it; includes torch)
        "peak_rss_mb_tokenise_byte": round(byte_peak, 1),
        "peak_rss_mb_bpe_train": round(bpe_train_peak, 1),
        "peak_rss_mb_tokenise_bpe": round(bpe_peak, 1),
    }


# --- 3. training throughput ----------------------------------------------------------------------


def batch_us(data, n: int = 200) -> float:
    sampler = ShardSampler(data.shards[0], batch_size=BATCH, seq_len=SEQ, seed=1)
    next(sampler)
    _, s = timed(lambda: [next(sampler) for _ in range(n)])
    return round(s / n * 1e6, 1)


def measure_training(corpus: Path, work: Path, repeats: int, rounds_per_side: int) -> dict:
    total = (1 + repeats * rounds_per_side) * H
    built = {
        name: trainer_for(config(work / "cache-byte", data, rounds=total // H))
        for name, data in (("bundled", None), ("user", corpus))
    }
    sides = {name: trainer.round for name, (trainer, _) in built.items()}
    tokens = rounds_per_side * WORKERS * H * BATCH * SEQ
    for name in ("bundled", "user"):  # warm-up: allocator, kernels, the first pages of the token files
        sides[name]()
    tps: dict[str, list[float]] = {"bundled": [], "user": []}
    for r in range(repeats):
        order = ("bundled", "user") if r % 2 == 0 else ("user", "bundled")
        for name in order:
            t = time.perf_counter()
            for _ in range(rounds_per_side):
                sides[name]()
            tps[name].append(tokens / (time.perf_counter() - t))
    ratios = [u / b for u, b in zip(tps["user"], tps["bundled"], strict=True)]
    return {
        "train_tokens_per_s_bundled": round(statistics.median(tps["bundled"]), 1),
        "train_tokens_per_s_user": round(statistics.median(tps["user"]), 1),
        "tokens_per_s_ratio": round(statistics.median(ratios), 4),
        "tokens_per_s_ratios": [round(x, 4) for x in ratios],
        "timed_tokens_per_side": repeats * tokens,
        "batch_us_bundled": batch_us(built["bundled"][1]),
        "batch_us_user": batch_us(built["user"][1]),
        "shard_spans_bundled": len(built["bundled"][1].shards[0].starts),
        "shard_spans_user": len(built["user"][1].shards[0].starts),
    }


# --- 4. peak RSS, in a child ---------------------------------------------------------------------


def child(args) -> None:
    baseline = _rss_mb()
    cfg = config(Path(args.child_cache), Path(args.child_data) if args.child_data else None)
    data, prepare_s = timed(prepare_data, cfg, progress=False)
    trainer = build_trainer(fit_model(cfg, data.tokenizer), data)
    _, s = timed(lambda: [trainer.round() for _ in range(args.child_rounds)])
    print(
        json.dumps(
            {
                # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through fork and exec
                "peak_rss_mb": round(_rss_mb("VmHWM"), 1),
                "rss_baseline_mb": round(baseline, 1),
                "cache_hit_s_fresh": round(prepare_s, 3),
                "tokens_per_s": round(args.child_rounds * WORKERS * H * BATCH * SEQ / s, 1),
            }
        )
    )


def run_child(cache: Path, corpus: Path | None, rounds: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--child-cache", str(cache), "--child-rounds", str(rounds)]
    if corpus is not None:
        cmd += ["--child-data", str(corpus)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=None, help="corpus size in MB (100; --quick: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated corpus")
    parser.add_argument(
        "--formats", default="jsonl", help="comma-separated, cycled over the 8 files: jsonl,parquet,csv,txt"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed A/B pairs (6; --quick: 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side per pair (2; --quick: 1)")
    parser.add_argument("--child-rounds", type=int, default=None, help="rounds per RSS child (4; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="a small corpus and few rounds (a smoke test)")
    parser.add_argument("--workdir", type=Path, default=None, help="for the corpus and caches (a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and caches")
    parser.add_argument("--out", type=Path, default=None, help="results/data_pipeline.json; --quick: none")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-cache", help=argparse.SUPPRESS)
    parser.add_argument("--child-data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    set_threads(THREADS)
    if args.child:
        child(args)
        return
    q = args.quick
    mb = args.mb if args.mb is not None else (8 if q else 100)
    repeats = args.repeats if args.repeats is not None else (2 if q else 6)
    rounds = args.rounds if args.rounds is not None else (1 if q else 2)
    child_rounds = args.child_rounds if args.child_rounds is not None else (1 if q else 4)
    formats = args.formats.split(",")
    out = args.out or (None if q else Path(__file__).parent / "results" / "data_pipeline.json")

    t0 = time.perf_counter()
    made = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="diloco-data-bench-")) if made else args.workdir
    corpus = work / "corpus"
    try:
        for cache in work.glob("cache-*"):
            shutil.rmtree(cache)
        recipe = {"mb": mb, "seed": args.seed, "formats": formats, "files": FILES}
        stamp = work / "corpus.json"
        if corpus.is_dir() and stamp.is_file() and json.loads(stamp.read_text())["recipe"] == recipe:
            shape = json.loads(stamp.read_text())["shape"]
            generate_s = 0.0
        else:
            shutil.rmtree(corpus, ignore_errors=True)
            shape, generate_s = timed(generate, corpus, mb, args.seed, formats)
            stamp.write_text(json.dumps({"recipe": recipe, "shape": shape}))
        tok = measure_tokenise(corpus, work, shape["corpus_mb"])
        train = measure_training(corpus, work, repeats, rounds)
        rss = {
            name: run_child(work / "cache-byte", data, child_rounds)
            for name, data in (("bundled", None), ("user", corpus))
        }
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        elif made:
            shutil.rmtree(work, ignore_errors=True)
        else:
            _clean(work)

    tokens_ok = train["tokens_per_s_ratio"] >= TARGET_TOKENS_RATIO
    rss_ratio = rss["user"]["peak_rss_mb"] / rss["bundled"]["peak_rss_mb"]
    result = {
        "benchmark": "data_pipeline",
        "quick": q,
        **shape,
        "generate_s": round(generate_s, 2),
        **tok,
        **train,
        "peak_rss_mb_bundled": rss["bundled"]["peak_rss_mb"],
        "peak_rss_mb_user": rss["user"]["peak_rss_mb"],
        "rss_ratio": round(rss_ratio, 3),
        "rss_baseline_mb_bundled": rss["bundled"]["rss_baseline_mb"],
        "rss_baseline_mb_user": rss["user"]["rss_baseline_mb"],
        "cache_hit_s_fresh_bundled": rss["bundled"]["cache_hit_s_fresh"],
        "cache_hit_s_fresh_user": rss["user"]["cache_hit_s_fresh"],
        "child_tokens_per_s": {k: v["tokens_per_s"] for k, v in rss.items()},
        "targets": {
            "tokens_per_s_ratio": {"target": f">= {TARGET_TOKENS_RATIO}", "met": tokens_ok},
            "rss_ratio": {"target": f"< {TARGET_RSS_RATIO}", "met": rss_ratio < TARGET_RSS_RATIO},
        },
        "model": "nano",
        "workers": WORKERS,
        "inner_steps": H,
        "batch_size": BATCH,
        "seq_len": SEQ,
        "procs": 1,
        "threads": THREADS,
        "repeats": repeats,
        "rounds_per_side": rounds,
        "child_rounds": child_rounds,
        "platform": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}",
        "duration_s": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def _clean(work: Path) -> None:
    """What this script put in a --workdir it was given."""
    shutil.rmtree(work / "corpus", ignore_errors=True)
    (work / "corpus.json").unlink(missing_ok=True)
    for cache in work.glob("cache-*"):
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
