"""The bundled Shakespeare corpus, a byte tokenizer, the validation split and worker shards.

Validation is the last `val_fraction` (5%) of every work, so every genre is represented and no
worker ever trains on it. Training text is the rest of each work. Shards (one per worker):

- `iid`: the training stream cut into 4 KiB blocks, shuffled with the seed, dealt out in equal
  counts; worker weights are 1/k.
- `genre`: non-i.i.d.; whole works grouped by genre (see `genre_groups`).
- `kmeans`: non-i.i.d.; works clustered into k groups by TF-IDF features with scikit-learn, as
  the DiLoCo paper clustered its documents.

Non-i.i.d. shards weight each worker's outer_grad by its shard's token count (ALGORITHMS.md §1).

    python -c "from diloco.data import load_corpus; print(len(load_corpus()))"
"""

from __future__ import annotations

import io
import json
import lzma
import tarfile
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np
import torch

from diloco.errors import UserError

IID_BLOCK_BYTES = 4096


@dataclass(frozen=True)
class Work:
    title: str
    genre: str
    text: bytes


@cache
def load_corpus() -> tuple[Work, ...]:
    """The 42 works shipped inside the package, in manifest order, checksums verified."""
    import hashlib

    blob = resources.files("diloco.corpus").joinpath("shakespeare.tar.xz").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(blob))) as tar:
        files = {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar if m.isfile()}
    manifest = json.loads(files["manifest.json"])
    works = []
    for entry in manifest["works"]:
        text = files[entry["file"]]
        if hashlib.sha256(text).hexdigest() != entry["sha256"]:
            raise RuntimeError(f"bundled corpus file {entry['file']} fails its checksum")
        works.append(Work(entry["title"], entry["genre"], text))
    return tuple(works)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless, no training."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode(errors="replace")


def split_work(text: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """(train, validation): validation is the last `val_fraction` of the work."""
    cut = len(text) - int(len(text) * val_fraction)
    return text[:cut], text[cut:]


def _tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def validation_tokens(works: tuple[Work, ...], val_fraction: float) -> torch.Tensor:
    return _tokens(b"".join(split_work(w.text, val_fraction)[1] for w in works))


def genre_groups(works: tuple[Work, ...], k: int) -> list[list[int]]:
    """Work indices per worker, each worker reading only a few genres. Deterministic.

    k <= number of genres: genres, largest first, go to the worker with the fewest bytes so far.
    k > number of genres: each genre gets workers in proportion to its size (at least one, by
    largest remainder), and its works go, largest first, to the lightest of its workers.
    """
    genres: dict[str, list[int]] = {}
    for i, w in enumerate(works):
        genres.setdefault(w.genre, []).append(i)
    size = {g: sum(len(works[i].text) for i in idx) for g, idx in genres.items()}
    order = sorted(genres, key=lambda g: (-size[g], g))
    if k <= len(order):
        groups: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        for g in order:
            j = min(range(k), key=lambda j: (load[j], j))
            groups[j] += genres[g]
            load[j] += size[g]
        return [sorted(g) for g in groups]
    total = sum(size.values())
    quota = {g: max(1, int(k * size[g] / total)) for g in order}
    by_remainder = sorted(order, key=lambda g: (-(k * size[g] / total - quota[g]), g))
    while sum(quota.values()) < k:
        for g in by_remainder:
            if sum(quota.values()) < k:
                quota[g] += 1
    while sum(quota.values()) > k:  # only when many tiny genres each took their minimum one
        g = max((g for g in order if quota[g] > 1), key=lambda g: (quota[g], g))
        quota[g] -= 1
    groups = []
    for g in order:
        sub: list[list[int]] = [[] for _ in range(quota[g])]
        load = [0] * quota[g]
        for i in sorted(genres[g], key=lambda i: (-len(works[i].text), i)):
            j = min(range(quota[g]), key=lambda j: (load[j], j))
            sub[j].append(i)
            load[j] += len(works[i].text)
        groups += [sorted(s) for s in sub]
    return groups


def kmeans_groups(works: tuple[Work, ...], k: int, seed: int) -> list[list[int]]:
    """Work indices per worker: k-means (scikit-learn) over TF-IDF features of each work."""
    from sklearn.cluster import KMeans
    from sklearn.feature_extraction.text import TfidfVectorizer

    docs = [w.text.decode("utf-8", errors="replace") for w in works]
    features = TfidfVectorizer(max_features=4096, sublinear_tf=True).fit_transform(docs)
    labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(features)
    return [sorted(np.flatnonzero(labels == c).tolist()) for c in range(k)]


def make_shards(
    works: tuple[Work, ...], k: int, *, kind: str, val_fraction: float, seed: int
) -> tuple[list[torch.Tensor], list[float]]:
    """Token shards (uint8 tensors), one per worker, and the outer_grad weights w_i."""
    train = [split_work(w.text, val_fraction)[0] for w in works]
    if kind == "iid":
        stream = b"".join(train)
        n_blocks = len(stream) // IID_BLOCK_BYTES // k * k
        if n_blocks == 0:
            raise UserError(f"the corpus is too small for {k} i.i.d. shards; use fewer --workers.")
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        blocks = [stream[b * IID_BLOCK_BYTES : (b + 1) * IID_BLOCK_BYTES] for b in perm]
        shards = [_tokens(b"".join(blocks[i::k])) for i in range(k)]
        return shards, [1.0 / k] * k
    if k > len(works):
        raise UserError(
            f"{kind} shards need at least one whole work per worker, but there are {len(works)} "
            f"works for {k} workers; use --workers {len(works)} or fewer, or --shards iid."
        )
    groups = genre_groups(works, k) if kind == "genre" else kmeans_groups(works, k, seed)
    shards = [_tokens(b"".join(train[i] for i in g)) for g in groups]
    total = sum(len(s) for s in shards)
    return shards, [len(s) / total for s in shards]


class ShardSampler:
    """Random windows from one shard: an endless iterator of (inputs_BT, targets_BT).

    Batch number n is drawn from a generator seeded by (seed, n) alone, so the data position is
    just `step` (what checkpoints save), and any process can produce any batch of any shard.
    """

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, seq_len: int, seed: int):
        need = batch_size * seq_len + 1
        if len(tokens) < need:
            raise UserError(
                f"a shard has {len(tokens)} tokens, fewer than one batch needs ({need}); "
                "use fewer --workers, a smaller --batch-size or a shorter --seq-len."
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        self.step += 1
        high = len(self.tokens) - self.seq_len
        starts_B = torch.randint(high, (self.batch_size,), generator=generator)
        offsets_BT = starts_B[:, None] + torch.arange(self.seq_len + 1)
        window_BT = self.tokens[offsets_BT].long()
        return window_BT[:, :-1], window_BT[:, 1:]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class ShardSet:
    """Batches from any of several shards: `seek(shard, step)` picks where the next batch comes
    from. The asynchronous server uses it to hand a worker a sampled shard at that shard's own
    position. Without a seek it reads its `current` shard (the worker's own)."""

    def __init__(self, samplers: list[ShardSampler], current: int):
        self.samplers = samplers
        self.current = current

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(self.samplers[self.current])

    def seek(self, shard: int, step: int) -> None:
        self.current = shard
        self.samplers[shard].step = step

    def state_dict(self) -> dict:
        return {"current": self.current, "steps": [s.step for s in self.samplers]}

    def load_state_dict(self, state: dict) -> None:
        self.current = int(state["current"])
        for sampler, step in zip(self.samplers, state["steps"], strict=True):
            sampler.step = int(step)


def eval_windows(tokens: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows of the validation stream, evenly spaced when
    `limit` picks a subset, so every method and runtime evaluates on the same windows."""
    n = (len(tokens) - 1) // seq_len
    if n == 0:
        raise UserError("the validation split is shorter than one window; use a shorter --seq-len.")
    idx = torch.arange(n) if limit is None or limit >= n else torch.linspace(0, n - 1, limit).long()
    offsets = idx[:, None] * seq_len + torch.arange(seq_len + 1)
    return tokens[offsets].long()
