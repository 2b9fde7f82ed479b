"""Worker shards, cut from the training pieces of a run's text:

- `iid`: the training stream cut into 4096-token blocks, shuffled with the seed, dealt out in
  equal counts; worker weights are 1/k.
- `genre` / `by-source`: non-i.i.d.; whole documents grouped by source: a bundled work's genre,
  a --data file, or the value of --source-field (see `source_groups`).
- `kmeans`: non-i.i.d.; documents clustered into k groups by TF-IDF features with scikit-learn,
  as the DiLoCo paper clustered its documents.

Non-i.i.d. shards weight each worker's outer_grad by its shard's token count (docs/method.md §1).
Which units go to which shard (the shard plan, shard_plan.py) is decided once per run and recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from diloco.data.shard_plan import ShardPlan
from diloco.data.text import Work
from diloco.data.tokens import TRAIN, Corpus, View
from diloco.errors import UserError

IID_BLOCK_TOKENS = 4096
KMEANS_UNIT_TOKENS = 4096  # what kmeans clusters: documents, long ones cut into parts this long

if TYPE_CHECKING:
    pass


def source_groups(sizes: list[int], labels: list[str], k: int) -> list[list[int]]:
    """Document indices per worker, each worker reading only a few sources (genres, files).
    Deterministic.

    k <= number of sources: sources, largest first, go to the worker with the fewest tokens so
    far. k > number of sources: each source gets workers in proportion to its size (at least
    one, by largest remainder; at most one per document of it), and its documents go, largest
    first, to the lightest of its workers, so every worker gets a document (k <= documents).
    """
    by_label: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        by_label.setdefault(label, []).append(i)
    size = {g: sum(sizes[i] for i in idx) for g, idx in by_label.items()}
    order = sorted(by_label, key=lambda g: (-size[g], g))
    if k <= len(order):
        groups: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        for g in order:
            j = min(range(k), key=lambda j: (load[j], j))
            groups[j] += by_label[g]
            load[j] += size[g]
        return [sorted(g) for g in groups]
    total = sum(size.values())
    quota = {g: max(1, int(k * size[g] / total)) for g in order}
    by_remainder = sorted(order, key=lambda g: (-(k * size[g] / total - quota[g]), g))
    while sum(quota.values()) < k:
        for g in by_remainder:
            if sum(quota.values()) < k:
                quota[g] += 1
    while sum(quota.values()) > k:  # only when many tiny sources each took their minimum one
        g = max((g for g in order if quota[g] > 1), key=lambda g: (quota[g], g))
        quota[g] -= 1
    # A source cannot feed more workers than it has documents: its surplus goes, one at a time,
    # to the source with the most tokens per worker that has documents to spare (k <= documents).
    count = {g: len(by_label[g]) for g in order}
    quota = {g: min(quota[g], count[g]) for g in order}
    while sum(quota.values()) < k:
        g = max((g for g in order if quota[g] < count[g]), key=lambda g: (size[g] / quota[g], g))
        quota[g] += 1
    groups = []
    for g in order:
        sub: list[list[int]] = [[] for _ in range(quota[g])]
        load = [0] * quota[g]
        for i in sorted(by_label[g], key=lambda i: (-sizes[i], i)):
            j = min(range(quota[g]), key=lambda j: (load[j], j))
            sub[j].append(i)
            load[j] += sizes[i]
        groups += [sorted(s) for s in sub]
    return groups


def genre_groups(works: tuple[Work, ...], k: int) -> list[list[int]]:
    """Work indices per worker for `genre` shards of the bundled corpus (see `source_groups`)."""
    return source_groups([len(w.text) for w in works], [w.genre for w in works], k)


def kmeans_groups(texts: list[str], k: int, seed: int) -> list[list[int]]:
    """Text indices per worker: k-means (scikit-learn) over TF-IDF features of each text, as the
    DiLoCo paper clustered its documents; groups in the order of their first text.

    As machine-independent as it can be (issue 29): the texts are clustered in sorted order, so
    the caller's order does not matter; the features are the 4,096 most frequent words with ties
    broken by the word (TfidfVectorizer's max_features breaks them with numpy's unstable sort,
    whose order depends on the CPU's SIMD: 183 words tie for the last 36 places in the bundled
    corpus); they stay sparse float64, so k-means runs scikit-learn's own loops rather than a
    BLAS whose kernels differ between CPUs; k-means++ is seeded with `seed` (numpy's
    MT19937, the same everywhere), Lloyd's algorithm, on one thread (threads split the sums
    differently). Logarithms (numpy's, SIMD too) and other library versions can still change a
    last bit, so a run makes its plan once and records and sends it (shard_plan.py)."""
    from sklearn.cluster import KMeans
    from sklearn.feature_extraction.text import CountVectorizer, TfidfTransformer
    from threadpoolctl import threadpool_limits

    order = sorted(range(len(texts)), key=texts.__getitem__)
    counts = CountVectorizer().fit_transform([texts[i] for i in order])  # words in sorted order
    totals = np.asarray(counts.sum(axis=0)).ravel()
    top = np.sort(np.lexsort((np.arange(len(totals)), -totals))[:4096])  # most frequent, ties by word
    features = TfidfTransformer(sublinear_tf=True).fit_transform(counts[:, top].astype(np.float64))
    with threadpool_limits(1):
        km = KMeans(n_clusters=k, init="k-means++", n_init=10, random_state=seed, algorithm="lloyd")
        labels_sorted = km.fit_predict(features)
    labels = np.empty(len(texts), np.int64)
    labels[order] = labels_sorted
    groups = [np.flatnonzero(labels == c).tolist() for c in range(k)]
    return sorted(groups, key=lambda g: g[0] if g else len(texts))


def kmeans_units(corpus: Corpus) -> tuple[View, list[tuple[int, int]]]:
    """What `kmeans` clusters: the training text as one sequence and its units, (lo, hi) ranges
    of it. A unit is a document, or a stretch of about KMEANS_UNIT_TOKENS of one (a long document
    is cut into equal parts), so a corpus of a few long works (the bundled one: 42) clusters like
    the paper's many web documents, into shards of comparable size, and not into whole works."""
    stream, sizes = _training_stream(corpus)
    units, lo = [], 0
    for size in sizes.tolist():
        if size:
            cuts = np.linspace(lo, lo + size, max(1, round(size / KMEANS_UNIT_TOKENS)) + 1).round()
            units += [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        lo += size
    return stream, units


def _training_stream(corpus: Corpus) -> tuple[View, np.ndarray]:
    """The training pieces as one sequence (they are in document order) and each document's
    training tokens in it."""
    train = np.flatnonzero(corpus.mask(TRAIN))
    weights = corpus.length[train]
    sizes = np.bincount(corpus.doc[train], weights=weights, minlength=corpus.meta["documents"])
    return corpus.view(train), sizes.astype(np.int64)


def shard_units(corpus: Corpus, kind: str) -> tuple[View, list[tuple[int, int]]]:
    """The training text as one sequence and the units (lo, hi) that `kind` deals out to
    workers: 4,096-token blocks (`iid`), `kmeans_units`, or documents with training text."""
    if kind == "kmeans":
        return kmeans_units(corpus)
    stream, sizes = _training_stream(corpus)
    if kind == "iid":
        return stream, [
            (b * IID_BLOCK_TOKENS, (b + 1) * IID_BLOCK_TOKENS) for b in range(len(stream) // IID_BLOCK_TOKENS)
        ]
    ends = np.cumsum(sizes)
    docs = np.unique(corpus.doc[corpus.mask(TRAIN)])  # documents with training text (not held out whole)
    return stream, list(zip((ends - sizes)[docs].tolist(), ends[docs].tolist(), strict=True))


def plan_shards(
    corpus: Corpus, k: int, *, kind: str, seed: int, decode: Callable[[np.ndarray], str] | None = None
) -> ShardPlan:
    """Which units go to which of the k workers (shard_plan.py): made once per run, by the
    process that starts it. `decode` (the tokenizer's) gives the text of the units `kmeans`
    clusters."""
    stream, units = shard_units(corpus, kind)
    if kind == "iid":
        n_blocks = len(units) // k * k
        if n_blocks == 0:
            raise UserError(
                f"the training text makes {len(units)} blocks of {IID_BLOCK_TOKENS:,} tokens, fewer than "
                f"{k} i.i.d. shards need (one each); give more text{', or fewer --workers' if units else ''}."
            )
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        groups = [perm[i::k] for i in range(k)]
    elif kind == "kmeans":
        assert decode is not None, "kmeans shards need the tokenizer's decode"
        if k > len(units):
            raise UserError(
                f"kmeans shards need a unit of text per worker (a document, or a ~{KMEANS_UNIT_TOKENS}-token "
                f"part of a long one), but the training text makes {len(units)} for {k} workers; use "
                f"--workers {len(units)} or fewer, or --shards iid."
            )
        texts = [decode(stream[torch.arange(a, b)].numpy()) for a, b in units]
        groups = kmeans_groups(texts, k, seed)
    else:
        docs = np.unique(corpus.doc[corpus.mask(TRAIN)])  # the documents `shard_units` made units of
        what = "works" if kind == "genre" else "documents with training text"
        if k > len(docs):
            raise UserError(
                f"{kind} shards need at least one whole document per worker, but there are {len(docs)} "
                f"{what} for {k} workers; use --workers {len(docs)} or fewer, or --shards iid."
            )
        labels = [corpus.sources[s] for s in corpus.doc_sources()[docs]]
        groups = source_groups(corpus.doc_sizes()[docs].tolist(), labels, k)
    tokens = [sum(units[u][1] - units[u][0] for u in g) for g in groups]
    if empty := [i for i, n in enumerate(tokens) if n == 0]:
        raise UserError(
            f"{kind} shards leave worker {empty[0]} without training text at --workers {k}; "
            f"use fewer --workers or --shards iid."
        )
    return ShardPlan(kind, seed, len(units), tuple(map(tuple, groups)), tuple(tokens))


def make_shards(corpus: Corpus, plan: ShardPlan) -> tuple[list[View], list[float]]:
    """Token shards (views of the corpus's training pieces), one per worker, cut by `plan`, and
    the outer_grad weights w_i. A plan made for another text is a UserError."""
    stream, units = shard_units(corpus, plan.kind)
    fits = len(units) == plan.units and all(0 <= u < len(units) for g in plan.groups for u in g)
    shards = [_ranges(stream, [units[u] for u in g]) for g in plan.groups] if fits else []
    if not fits or [len(s) for s in shards] != list(plan.tokens):
        mine = f"{sum(map(len, shards)):,} tokens in " if fits else ""
        raise UserError(
            f"the shard plan of {plan.source} does not fit this training text (its shards hold "
            f"{sum(plan.tokens):,} tokens in {plan.units} units, here {mine}{len(units)} units); use the "
            "same --data files, tokenizer and diloco as the machine that made it."
        )
    if plan.kind == "iid":
        return shards, [1.0 / len(shards)] * len(shards)
    total = sum(len(s) for s in shards)
    return shards, [len(s) / total for s in shards]


def _ranges(stream: View, ranges: list[tuple[int, int]]) -> View:
    """The view of `stream` made of these (lo, hi) ranges of it, in this order."""
    starts, lengths = [], []
    for lo, hi in ranges:
        first = int(np.searchsorted(stream.offsets, lo, side="right")) - 1
        while lo < hi:
            take = min(hi, int(stream.offsets[first + 1])) - lo
            starts.append(int(stream.starts[first]) + lo - int(stream.offsets[first]))
            lengths.append(take)
            lo += take
            first += 1
    return View(stream.file, starts, lengths)


# --- a run's text: where it comes from, its tokenizer, its tokens --------------------------------
