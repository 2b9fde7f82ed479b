"""A run's text: the bundled Shakespeare or the user's --data, its validation split, its
tokenizer and its tokens (cached).

Validation:
- the bundled corpus: the last `val_fraction` (5%) of every work, so every genre is represented;
- --data: whole documents, about `val_fraction` of them, chosen by a hash of their text (so the
  choice survives added files), or the end of every document when that picks less than half of
  `val_fraction` of the text (a few short documents) or more than twice it (a handful of books);
  or all of --val-data.
No worker ever trains on it. With --tune-fraction, the end of every training text is a tuning
split (held out of training, and of validation), which `--eval-on tune` scores instead.

    python -c "from diloco.data.text import load_corpus; print(len(load_corpus()))"
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import shutil
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache, partial
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.data.formats import Document
from diloco.data.tokens import (
    TRAIN,
    Corpus,
    Piece,
    cache_root,
    digest,
    is_val_document,
    locked,
    pieces,
    tokenise,
)

if TYPE_CHECKING:
    from diloco.config import DataConfig


VAL_SHARE_LIMIT = 2.0  # whole documents are held out only if they make val_fraction within this factor


@dataclass(frozen=True)
class Work:
    title: str
    genre: str
    text: bytes


@cache
def load_corpus() -> tuple[Work, ...]:
    """The 42 works shipped inside the package, in manifest order, checksums verified."""
    blob = resources.files("diloco.data.corpus").joinpath("shakespeare.tar.xz").read_bytes()
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


def bundled_documents() -> Iterator[Document]:
    """The bundled works as documents, their genre as source (what `genre` shards group by)."""
    for w in load_corpus():
        yield Document(w.text.decode(), w.genre)


def bundled_fingerprint() -> str:
    return hashlib.sha256(
        resources.files("diloco.data.corpus").joinpath("shakespeare.tar.xz").read_bytes()
    ).hexdigest()


TOKENIZER_FILE = "tokenizer.json"  # a run's tokenizer (bpe:N or a file), saved in its directory
DATA_FILE = "data.json"  # fingerprints of the text a run trains on (data.recipe.check_data)


@dataclass(frozen=True)
class Text:
    """Where text comes from: its documents (read again on every call), their fingerprint and
    size in bytes (for progress bars)."""

    documents: Callable[[], Iterator[Document]]
    fingerprint: str
    size: int
    bundled: bool = False


def bundled_text() -> Text:
    return Text(
        bundled_documents, bundled_fingerprint(), sum(len(w.text) for w in load_corpus()), bundled=True
    )


def user_text(paths: Iterable[str], *, text_field: str, source_field: str) -> Text:
    from diloco.data import sources

    files = sources.expand(list(paths))
    size = sum(f.stat().st_size if f.is_file() else _folder_size(f) for f in files)
    read = partial(sources.read_documents, files, text_field=text_field, source_field=source_field)
    return Text(read, sources.fingerprint(files, text_field=text_field, source_field=source_field), size)


def _folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def training_pieces(
    text: Text, val_fraction: float, *, separate_val: bool, tune_fraction: float = 0.0
) -> Callable[[], Iterator[Piece]]:
    """The pieces of a run's training text: the bundled corpus holds out the tail of every work;
    user data holds out whole documents (`is_val_document`: about `val_fraction` of them), or
    the tail of each one when that rule's share of the text is not within a factor
    VAL_SHARE_LIMIT of `val_fraction` (too few documents for the rule: two books, one held out,
    would hold out half; 91 rows of which the hash picks one short one, almost nothing); with a
    separate validation text, none. With `tune_fraction`, the end of each training piece is
    tuning text (`pieces`)."""
    held = bytearray()  # per document: validation? (decided once, on the first call)
    share = [0.0]  # the held documents' share of the text (characters)

    cut = partial(pieces, tune_fraction=tune_fraction)

    def make() -> Iterator[Piece]:
        if separate_val:
            return cut(text.documents(), val_fraction=0.0, whole=True)
        if text.bundled:
            return cut(text.documents(), val_fraction=val_fraction, whole=False)
        if not held:
            sizes = []
            for doc in text.documents():
                held.append(is_val_document(doc.text, val_fraction))
                sizes.append(len(doc.text))
            share[0] = sum(n for n, h in zip(sizes, held, strict=True) if h) / max(1, sum(sizes))
        whole = val_fraction / VAL_SHARE_LIMIT <= share[0] <= VAL_SHARE_LIMIT * val_fraction and share[0] < 1
        return cut(text.documents(), val_fraction=val_fraction, whole=whole, held=held)

    return make


def load_tokenizer(cfg: DataConfig, text: Text, train: Callable[[], Iterator[Piece]], run_dir: Path | None):
    """A run's tokenizer: the one saved in its directory (resume, eval, generate), else what
    `--tokenizer` says; a BPE trained on the training pieces is cached like tokens are."""
    from diloco.data import tokenizer as tk

    if run_dir is not None and (run_dir / TOKENIZER_FILE).is_file():
        return tk.load_tokenizer_file(run_dir / TOKENIZER_FILE)
    kind, arg = tk.parse_spec(cfg.tokenizer)
    if kind != "bpe":
        return tk.build_tokenizer(cfg.tokenizer, lambda: ())
    root = cache_root(cfg.cache_dir)
    tune = (cfg.tune_fraction,) if cfg.tune_fraction else ()  # none: the name it always had
    name = "bpe-" + digest(text.fingerprint, cfg.val_fraction, bool(cfg.val_data), arg, *tune)
    path = root / f"{name}.json"
    with locked(root, name):
        if not path.is_file():
            trained = tk.train_bpe((p.text for p in train() if p.val == TRAIN), arg)
            tmp = root / f"{name}.tmp-{os.getpid()}"
            tmp.mkdir(exist_ok=True)
            os.replace(trained.save(tmp), path)
            shutil.rmtree(tmp, ignore_errors=True)
    return tk.load_tokenizer_file(path)


def tokenised(
    text: Text, make: Callable[[], Iterator[Piece]], tokenizer, key: dict, cfg: DataConfig, progress
) -> Corpus:
    return tokenise(
        make,
        tokenizer,
        key={"text": text.fingerprint, **key},
        cache_dir=cfg.cache_dir,
        total_chars=text.size,
        progress=progress,
    )


def eval_corpus(text: Text, tokenizer, cfg: DataConfig, progress: bool | None = None) -> Corpus:
    """Every document of `text` as validation (`--val-data`, `diloco eval --data`)."""
    make = partial(pieces, val_fraction=1.0, whole=True, all_val=True)
    return tokenised(text, lambda: make(text.documents()), tokenizer, {"all": "val"}, cfg, progress)
