"""Tokenised text on disk: documents in, a memory-mapped token file out, read through views.

A corpus (the bundled one, or the user's `--data`) is tokenised once per (data, split settings,
tokenizer) and cached under the cache directory (`--cache-dir`, else $DILOCO_CACHE, else
~/.cache/diloco) in a folder named by the hash of those three:

    tokens.bin   every piece's tokens, in order (uint8, uint16 or uint32, by vocabulary size)
    pieces.npz   per piece: start, length, document, source, whether it is validation
    meta.json    the dtype, the sources' names, counts, and what the key was made from

A piece is a whole document, or, when a document is split, its training head or its validation
tail. Training reads the file through `View`s (a shard, a split): spans of it read as one
sequence, so a corpus larger than memory trains with bounded memory and a second run with the
same data and tokenizer starts without tokenising anything. Building takes a lock on the cache
folder, so ranks started together tokenise once; the folder appears whole (rename) or not at all.

    python -c "from diloco.data.recipe import prepare_data; from diloco.config import TrainConfig; \
print(prepare_data(TrainConfig()).corpus.meta['tokens'])"
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diloco.data.formats import Document
from diloco.errors import UserError

FORMAT = 1  # of the cache folder; a new format is a new key, never a misread
BATCH_CHARS = 1 << 20  # documents are tokenised in batches of about this many characters


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("DILOCO_CACHE") or Path.home() / ".cache" / "diloco")


def digest(*parts: object) -> str:
    """A short hex hash of JSON-able parts (cache keys)."""
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


@contextlib.contextmanager
def locked(root: Path, name: str):
    """An exclusive lock on root/.locks/name.lock while building one cache entry (other processes
    wait)."""
    try:
        (root / ".locks").mkdir(parents=True, exist_ok=True)
        handle = open(root / ".locks" / f"{name}.lock", "w")  # noqa: SIM115 (held for the block)
    except OSError as e:
        raise UserError(
            f"cannot write the token cache in {root} ({e.strerror}); give a writable --cache-dir."
        ) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def token_dtype(vocab_size: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocabulary of {vocab_size} does not fit 32 bits")


@functools.cache
def _memmap(path: str, dtype: str) -> np.ndarray:
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


@dataclass(frozen=True)
class TokenFile:
    """A file of token ids; pickles as its path, and each process maps it once."""

    path: str
    dtype: str

    def array(self) -> np.ndarray:
        return _memmap(self.path, self.dtype)


class View:
    """Spans of a token file read as one sequence: `len`, and indexing with an integer tensor
    (any shape) gives the int64 tokens at those positions. Adjacent spans are merged."""

    def __init__(self, file: TokenFile | np.ndarray, starts: Iterable[int], lengths: Iterable[int]):
        self.file = file
        starts = np.asarray(starts if isinstance(starts, np.ndarray) else list(starts), np.int64)
        lengths = np.asarray(lengths if isinstance(lengths, np.ndarray) else list(lengths), np.int64)
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        if len(starts) > 1:  # merge spans that continue one another
            new = np.flatnonzero(starts[1:] != starts[:-1] + lengths[:-1]) + 1
            bounds = np.concatenate([[0], new, [len(starts)]])
            lengths = np.add.reduceat(lengths, bounds[:-1])
            starts = starts[bounds[:-1]]
        self.starts, self.lengths = starts, lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _array(self) -> np.ndarray:
        return self.file.array() if isinstance(self.file, TokenFile) else self.file

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        flat = np.asarray(index, dtype=np.int64).reshape(-1)
        if len(self.starts) == 1:
            physical = self.starts[0] + flat
        else:
            span = np.searchsorted(self.offsets, flat, side="right") - 1
            physical = self.starts[span] + flat - self.offsets[span]
        values = self._array()[physical].astype(np.int64)
        return torch.from_numpy(values).reshape(tuple(index.shape))

    def numpy(self) -> np.ndarray:
        """The whole sequence, copied into memory (small views only)."""
        array = self._array()
        return np.concatenate(
            [array[s : s + n] for s, n in zip(self.starts, self.lengths, strict=True)] or [array[:0]]
        )


@dataclass
class Corpus:
    """A tokenised corpus: its token file and its pieces (numpy arrays, one entry per piece)."""

    file: TokenFile
    start: np.ndarray
    length: np.ndarray
    doc: np.ndarray
    source: np.ndarray
    val: np.ndarray  # bool: a validation piece
    meta: dict
    tune: np.ndarray | None = None  # bool: a tuning piece (caches before the tuning split: none)

    def __post_init__(self):
        if self.tune is None:
            self.tune = np.zeros_like(self.val, dtype=bool)

    @property
    def sources(self) -> list[str]:
        return self.meta["sources"]

    def view(self, pieces: np.ndarray | Iterable[int]) -> View:
        pieces = np.asarray(list(pieces) if not isinstance(pieces, np.ndarray) else pieces, np.int64)
        return View(self.file, self.start[pieces], self.length[pieces])

    def mask(self, part: int) -> np.ndarray:
        """Which pieces are in one split: TRAIN, VAL or TUNE (True and False: VAL and TRAIN)."""
        return {TRAIN: ~(self.val | self.tune), VAL: self.val, TUNE: self.tune}[int(part)]

    def split(self, part: int) -> View:
        """The pieces of one split: TRAIN, VAL or TUNE."""
        return self.view(np.flatnonzero(self.mask(part)))

    def doc_sizes(self) -> np.ndarray:
        """Tokens per document (all its pieces)."""
        return np.bincount(self.doc, weights=self.length, minlength=self.meta["documents"]).astype(np.int64)

    def doc_sources(self) -> np.ndarray:
        out = np.zeros(self.meta["documents"], np.int64)
        out[self.doc] = self.source
        return out


# --- splitting documents into training, validation and tuning pieces ---------------------------
TRAIN, VAL, TUNE = 0, 1, 2  # the splits; tuning text is held out of training and of validation


@dataclass(frozen=True)
class Piece:
    text: str
    source: str
    doc: int
    val: int  # TRAIN, VAL or TUNE
    ends_document: bool


def tail_cut(text: str, fraction: float) -> tuple[str, str]:
    """(head, tail): the tail is the last `fraction` of the text's UTF-8 bytes, cut at a
    character boundary (the bundled corpus's rule: bit for bit the old byte cut on ASCII)."""
    data = text.encode()
    cut = len(data) - int(len(data) * fraction)
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:  # never inside a character
        cut += 1
    return data[:cut].decode(), data[cut:].decode()


def is_val_document(text: str, fraction: float) -> bool:
    """Whole-document rule: a document is validation when a hash of its text falls in the first
    `fraction` of the hash range. The choice stays with the document however the corpus grows or
    is reordered, and copies of a document fall on the same side."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return h < fraction * 2**64


def pieces(
    docs: Iterable[Document],
    *,
    val_fraction: float,
    whole: bool,
    all_val: bool = False,
    held: Sequence[int] | None = None,
    tune_fraction: float = 0.0,
) -> Iterator[Piece]:
    """The pieces of `docs`: whole documents picked by `is_val_document` (or by `held`, its
    answers computed already), or (whole=False) every document's head and tail (`tail_cut`);
    with all_val every document is validation. With `tune_fraction`, the end of each training
    piece (that fraction of it) is tuning text."""
    for i, d in enumerate(docs):
        if all_val or whole:
            val = all_val or (held[i] if held is not None else is_val_document(d.text, val_fraction))
            if val:
                yield Piece(d.text, d.source, i, VAL, True)
            else:
                yield from _train_pieces(d, i, d.text, tune_fraction, ends_document=True)
        else:
            head, tail = tail_cut(d.text, val_fraction)
            yield from _train_pieces(d, i, head, tune_fraction, ends_document=not tail)
            if tail:
                yield Piece(tail, d.source, i, VAL, True)


def _train_pieces(d: Document, i: int, text: str, tune_fraction: float, *, ends_document: bool):
    """A document's training text: one piece, or its head and, with a tuning split, its tail."""
    if not tune_fraction:
        yield Piece(text, d.source, i, TRAIN, ends_document)
        return
    head, tune = tail_cut(text, tune_fraction)
    yield Piece(head, d.source, i, TRAIN, ends_document and not tune)
    if tune:
        yield Piece(tune, d.source, i, TUNE, ends_document)


# --- building and loading a cache entry ---------------------------------------------------------


def tokenise(
    make_pieces: Callable[[], Iterable[Piece]],
    tokenizer,
    *,
    key: dict,
    cache_dir: str = "",
    total_chars: int | None = None,
    progress: bool | None = None,
) -> Corpus:
    """The corpus for `key` (what the pieces are made from) and `tokenizer`: from the cache, or
    tokenised now (in batches, on all cores for Hugging Face tokenizers) and cached."""
    root = cache_root(cache_dir)
    name = "tokens-" + digest(FORMAT, key, tokenizer.fingerprint())
    folder = root / name
    if (corpus := _load(folder)) is not None:
        return corpus
    with locked(root, name):
        if (corpus := _load(folder)) is not None:  # another process built it while we waited
            return corpus
        tmp = root / f"{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _build(tmp, make_pieces(), tokenizer, key=key, total_chars=total_chars, progress=progress)
            for f in tmp.iterdir():  # on disk before the entry is renamed into place
                with open(f, "rb") as handle:
                    os.fsync(handle.fileno())
            shutil.rmtree(folder, ignore_errors=True)  # a damaged earlier entry
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    corpus = _load(folder)
    assert corpus is not None, folder
    return corpus


def _build(folder: Path, items: Iterable[Piece], tokenizer, *, key, total_chars, progress) -> None:
    from tqdm import tqdm

    dtype = token_dtype(tokenizer.vocab_size)
    eos = tokenizer.eos_id
    cols = {name: array("q") for name in ("length", "doc", "source", "val")}  # compact, per piece
    source_ids: dict[str, int] = {}
    bar = tqdm(
        total=total_chars,
        unit="char",
        unit_scale=True,
        desc="tokenising",
        disable=None if progress is None else not progress,
    )
    batch: list[Piece] = []
    chars = 0

    def flush(out) -> None:
        nonlocal chars
        for piece, ids in zip(batch, tokenizer.encode_batch([p.text for p in batch]), strict=True):
            ids = np.asarray(ids)
            if eos is not None and piece.ends_document:
                ids = np.append(ids, eos)
            if len(ids) and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise ValueError(
                    f"the tokenizer gave id {ids.max()} outside its vocabulary of {tokenizer.vocab_size}"
                )
            out.write(ids.astype(dtype).tobytes())
            cols["length"].append(len(ids))
            cols["doc"].append(piece.doc)
            cols["source"].append(source_ids.setdefault(piece.source, len(source_ids)))
            cols["val"].append(piece.val)
        bar.update(chars)
        batch.clear()
        chars = 0

    try:
        with open(folder / "tokens.bin", "wb") as out:
            for piece in items:
                batch.append(piece)
                chars += len(piece.text)
                if chars >= BATCH_CHARS:
                    flush(out)
            flush(out)
    finally:
        bar.close()
    length = np.asarray(cols["length"], np.int64)
    start = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64) if len(length) else length
    doc = np.asarray(cols["doc"], np.int64)
    np.savez(
        folder / "pieces.npz",
        start=start,
        length=length,
        doc=doc,
        source=np.asarray(cols["source"], np.int64),
        val=np.asarray(cols["val"], np.int64) == VAL,
        tune=np.asarray(cols["val"], np.int64) == TUNE,
    )
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "tokens": int(length.sum()),
        "documents": int(doc.max()) + 1 if len(doc) else 0,
        "sources": list(source_ids),
        "vocab_size": tokenizer.vocab_size,
        "key": key,
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def _load(folder: Path) -> Corpus | None:
    """The cached corpus in `folder`, or None if it is missing or damaged (then it is rebuilt)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        with np.load(folder / "pieces.npz") as z:
            cols = {k: z[k] for k in ("start", "length", "doc", "source", "val", "tune") if k in z}
        path = folder / "tokens.bin"
        if (
            meta.get("format") != FORMAT
            or path.stat().st_size != meta["tokens"] * np.dtype(meta["dtype"]).itemsize
        ):
            return None
    except Exception:  # missing, truncated, not a zip, ...: rebuilt
        return None
    return Corpus(TokenFile(str(path), meta["dtype"]), meta=meta, **cols)
