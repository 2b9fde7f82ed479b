"""A user's own training text, read as documents from local files (`diloco train --data PATH`).

`expand` turns the paths given into input files: files as given, folders recursively in sorted
order (hidden files and folders skipped), and a folder written by `datasets`' `save_to_disk` as
one input. `read_documents` streams every input's documents, chosen by suffix (any case):

- `.jsonl`: one JSON object per line, the document is its `text_field`; `.json`: the same, or a
  JSON array of such objects when the file starts with `[`.
- `.parquet` and `.csv`: the `text_field` column, a batch (parquet) or a row (csv) at a time.
- a `save_to_disk` folder: its `text_field` column (a DatasetDict: its `train` split).
- anything else: plain UTF-8 text, the whole file one document; a file over `BIG_FILE_BYTES`
  comes in pieces of at most `PIECE_BYTES` that end just after a newline.

A document's `source` (what `--shards by-source` groups by) is its input's path, or the row's
`source_field` when one is named. Blank texts are skipped. Bad input raises `UserError` with one
sentence that names the file (and line or row) and the fix. `fingerprint` hashes the inputs'
names and bytes, so a run can tell whether its data changed.

    python -c "from diloco.data.sources import read_documents as r; print(len(list(r(['README.md']))))"
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from diloco.data.formats import Document, kind, read
from diloco.errors import UserError

HASH_BLOCK_BYTES = 1 << 20


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "dataset_info.json").is_file() and (folder / "state.json").is_file()
    )


def _walk(folder: Path, seen: set[Path]) -> Iterator[Path]:
    real = folder.resolve()
    if real in seen:  # a symlink loop
        return
    seen.add(real)
    for child in sorted(folder.iterdir(), key=lambda p: p.name):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            if _is_saved_dataset(child):
                yield child
            else:
                yield from _walk(child, seen)
        elif child.is_file():
            yield child


def _inputs(paths: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """(input, its name relative to the path given) for every input, in order."""
    if isinstance(paths, str | Path):
        paths = [paths]
    inputs = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise UserError(f"{path} does not exist; check the path given to --data.")
        if path.is_dir() and not _is_saved_dataset(path):
            found = [(p, p.relative_to(path).as_posix()) for p in _walk(path, set())]
            if not found:
                raise UserError(f"the folder {path} holds no files; put the training text in it.")
            inputs += found
        else:
            inputs.append((path, path.name))
    return inputs


def expand(paths: Sequence[str | Path]) -> list[Path]:
    """The input files and save_to_disk folders of `paths`, in a deterministic order."""
    return [path for path, _ in _inputs(paths)]


def read_documents(
    paths: Sequence[str | Path], *, text_field: str = "text", source_field: str = ""
) -> Iterator[Document]:
    """Every document of every input, in order, streamed."""
    for path in expand(paths):
        count = 0
        for doc in read(path, text_field, source_field):
            count += 1
            yield doc
        if not count:
            plain = kind(path) == "text" or (path.is_file() and not path.stat().st_size)
            what = "" if plain else f' in its "{text_field}" field'
            raise UserError(f"{path} has no text{what}; add documents to it or leave it out of --data.")


def _hash_file(h: hashlib.blake2b, path: Path, name: str) -> None:
    encoded = name.encode("utf-8", "surrogateescape")
    h.update(len(encoded).to_bytes(8, "little") + encoded + path.stat().st_size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK_BYTES):
            h.update(block)


def fingerprint(paths: Sequence[str | Path], *, text_field: str = "text", source_field: str = "") -> str:
    """A hex digest of the inputs' names relative to the paths given, sizes, bytes and the fields."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(["diloco.sources/1", text_field, source_field]).encode())
    for path, name in _inputs(paths):
        if path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                _hash_file(h, file, f"{name}/{file.relative_to(path).as_posix()}")
        else:
            _hash_file(h, path, name)
    return h.hexdigest()
