"""The formats a document comes in, each read as a stream of `Document`s: plain UTF-8 text
(a file over `BIG_FILE_BYTES` in pieces of at most `PIECE_BYTES` that end just after a newline),
`.jsonl`, `.json`, `.csv`, `.parquet`, and a folder saved by `datasets`' `save_to_disk`. Bad
input raises `UserError` with one sentence that names the file (and line or row) and the fix.
sources.py finds the inputs and picks their reader with `read`.

    python -c "from pathlib import Path; from diloco.data.formats import read; \
print(len(list(read(Path('README.md'), 'text', ''))))"
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from diloco.errors import UserError

BIG_FILE_BYTES = 64 << 20  # plain text files larger than this are read in pieces
PIECE_BYTES = 16 << 20  # the most bytes of one piece of a big plain text file
BATCH_ROWS = 1024  # rows per batch read from parquet files and datasets
SNIFF_BYTES = 8192  # a NUL byte among these makes a file binary
KINDS = "plain text, .jsonl, .json, .csv, .parquet or a folder saved with datasets' save_to_disk"
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Document:
    text: str
    source: str


def kind(path: Path) -> str:
    if path.is_dir():
        return "dataset"
    suffix = path.suffix.lower()
    return suffix[1:] if suffix in (".jsonl", ".json", ".parquet", ".csv") else "text"


def _check_text_file(path: Path) -> bool:
    """Refuse a binary file; False if the file is empty."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        raise UserError(f"{path} is a binary file, not text; leave it out of --data, which reads {KINDS}.")
    return bool(head)


def _decode(data: bytes, path: Path, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path} is not UTF-8 text (invalid byte at offset {offset + e.start}); "
            "convert it to UTF-8 (e.g. with iconv) and try again."
        ) from None


def _lines(path: Path, universal: bool = False) -> Iterator[tuple[int, str]]:
    """(line number, line with its newline) of a UTF-8 file, streamed; a leading BOM dropped.

    Lines end at LF, or with `universal` (as open(newline="") splits them) at CR, CRLF or LF.
    """
    offset = 0
    lineno = 0
    with open(path, "rb") as f:
        for raw in f:
            for line in raw.splitlines(keepends=True) if universal and b"\r" in raw else (raw,):
                lineno += 1
                start = 3 if offset == 0 and line.startswith(_BOM) else 0
                yield lineno, _decode(line[start:], path, offset + start)
                offset += len(line)


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _row_document(
    obj: object, where: str, text_field: str, source_field: str, default_source: str
) -> Document | None:
    """The document of one parsed JSON value; `where` names the file and line (or item)."""
    if not isinstance(obj, dict):
        raise UserError(
            f"{where} is a JSON {_type_name(obj)}, not an object; "
            f'write one JSON object with a "{text_field}" field per line.'
        )
    if text_field not in obj:
        keys = ", ".join(f'"{k}"' for k in list(obj)[:20]) or "none"
        raise UserError(
            f'{where} has no "{text_field}" field (its fields: {keys}); '
            "name the text field with --text-field."
        )
    text = obj[text_field]
    if not isinstance(text, str):
        raise UserError(
            f'{where}: the "{text_field}" field is a {_type_name(text)}, not a string; '
            "name the text field with --text-field."
        )
    if not text.strip():
        return None
    try:
        text.isascii() or text.encode()  # (ASCII is valid; the check costs only other text)
    except UnicodeEncodeError as e:  # a lone surrogate from a "\ud800" escape
        raise UserError(
            f'{where}: the "{text_field}" field holds {text[e.start]!r} at character {e.start}, '
            "which is not a Unicode character (half of a surrogate pair); fix that escape."
        ) from None
    source = default_source
    if source_field:
        if obj.get(source_field) is None:
            raise UserError(
                f'{where} has no "{source_field}" field; '
                "give every row one or name another with --source-field."
            )
        source = str(obj[source_field])
    return Document(text, source)


def _read_jsonl(path: Path, text_field: str, source_field: str) -> Iterator[Document]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{path}:{lineno} is not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}); "
                f'write one JSON object with a "{text_field}" field per line.'
            ) from None
        doc = _row_document(obj, f"{path}:{lineno}", text_field, source_field, str(path))
        if doc is not None:
            yield doc


def _read_json(path: Path, text_field: str, source_field: str) -> Iterator[Document]:
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES).removeprefix(_BOM).lstrip()
        while not head and f.peek(1):  # leading whitespace longer than one read
            head = f.read(SNIFF_BYTES).lstrip()
    if not head.startswith(b"["):
        yield from _read_jsonl(path, text_field, source_field)
        return
    text = _decode(path.read_bytes(), path, 0).removeprefix("\ufeff")
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path}:{e.lineno} is not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}); "
            "fix it, or write JSON Lines (one object per line) instead."
        ) from None
    for i, obj in enumerate(items):
        doc = _row_document(obj, f"{path} item {i}", text_field, source_field, str(path))
        if doc is not None:
            yield doc


def _missing_column(path: Path, field: str, columns: Sequence[str], flag: str) -> UserError:
    names = ", ".join(f'"{c}"' for c in columns) or "none"
    return UserError(f'{path} has no "{field}" column (its columns: {names}); name the column with {flag}.')


def _columns_ok(path: Path, columns: Sequence[str], text_field: str, source_field: str) -> None:
    if text_field not in columns:
        raise _missing_column(path, text_field, columns, "--text-field")
    if source_field and source_field not in columns:
        raise _missing_column(path, source_field, columns, "--source-field")


def _batch_documents(
    path: Path, texts: list, sources: list | None, first_row: int, source_field: str
) -> Iterator[Document]:
    for i, text in enumerate(texts):
        if text is None or not text.strip():
            continue
        source = str(path)
        if sources is not None:
            if sources[i] is None:
                raise UserError(
                    f'{path} row {first_row + i} has no "{source_field}" value; '
                    "fill it in or name another column with --source-field."
                )
            source = str(sources[i])
        yield Document(text, source)


def _not_text_column(path: Path, field: str, kind: str) -> UserError:
    return UserError(
        f'{path}: the "{field}" column holds {kind}, not text; name the text column with --text-field.'
    )


def _read_parquet(path: Path, text_field: str, source_field: str) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def unreadable(e: Exception) -> UserError:
        return UserError(
            f"{path} is not a parquet file pyarrow can read ({e}); "
            "write it again (e.g. with pyarrow or pandas' to_parquet) or give another format."
        )

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise unreadable(e) from None
    schema = pf.schema_arrow
    _columns_ok(path, schema.names, text_field, source_field)
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise _not_text_column(path, text_field, str(kind))
    columns = [text_field] + ([source_field] if source_field and source_field != text_field else [])
    row = 0
    batches = pf.iter_batches(columns=columns, batch_size=BATCH_ROWS)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowInvalid, OSError) as e:
            raise unreadable(e) from None
        if batch is None:
            return
        texts = batch.column(text_field).to_pylist()
        sources = batch.column(source_field).to_pylist() if source_field else None
        yield from _batch_documents(path, texts, sources, row, source_field)
        row += batch.num_rows


def _read_csv(path: Path, text_field: str, source_field: str) -> Iterator[Document]:
    csv.field_size_limit(min(2**31 - 1, sys.maxsize))
    reader = csv.DictReader(line for _, line in _lines(path, universal=True))
    start = 1  # the line the record being read starts on
    try:
        columns = reader.fieldnames or []
        _columns_ok(path, columns, text_field, source_field)
        start = reader.line_num + 1
        for row in reader:
            where = f"{path}:{start}"
            start = reader.line_num + 1
            text = row[text_field]
            if text is None or not text.strip():
                continue
            source = str(path)
            if source_field:
                if row[source_field] is None:
                    raise UserError(
                        f'{where} has no "{source_field}" value; '
                        "fill it in or name another column with --source-field."
                    )
                source = row[source_field]
            yield Document(text, source)
    except csv.Error as e:
        raise UserError(
            f"{path}:{start} is not valid CSV ({e}); quote fields that hold commas, quotes or newlines."
        ) from None


def _read_dataset(path: Path, text_field: str, source_field: str) -> Iterator[Document]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError) as e:  # FileNotFoundError, JSONDecodeError, ArrowInvalid
        raise UserError(
            f"{path} could not be loaded by datasets.load_from_disk ({e}); save the dataset again "
            "with save_to_disk."
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            splits = ", ".join(f'"{s}"' for s in ds) or "none"
            raise UserError(
                f'{path} has no "train" split (its splits: {splits}); give the split\'s own folder '
                f"({path}/SPLIT) to --data."
            )
        ds = ds["train"]
    _columns_ok(path, ds.column_names, text_field, source_field)
    feature = ds.features[text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string", "string_view"):
        raise _not_text_column(path, text_field, str(feature))
    columns = [text_field] + ([source_field] if source_field and source_field != text_field else [])
    row = 0
    for batch in ds.select_columns(columns).with_format(None).iter(batch_size=BATCH_ROWS):
        texts, sources = batch[text_field], batch[source_field] if source_field else None
        yield from _batch_documents(path, texts, sources, row, source_field)
        row += len(texts)


def _read_text(path: Path) -> Iterator[Document]:
    size = path.stat().st_size
    if size <= BIG_FILE_BYTES:
        data = path.read_bytes()
        start = 3 if data.startswith(_BOM) else 0
        text = _decode(data[start:], path, start)
        if text.strip():
            yield Document(text, str(path))
        return
    offset = 0  # of buf[0] in the file
    buf = b""
    with open(path, "rb") as f:
        while True:
            buf += f.read(PIECE_BYTES - len(buf))
            cut = len(buf)  # fewer bytes than asked for: the end of the file
            if cut == PIECE_BYTES:
                cut = buf.rfind(b"\n") + 1
                if cut == 0:  # no newline at all: cut between two UTF-8 characters
                    cut = PIECE_BYTES
                    try:
                        buf.decode("utf-8")
                    except UnicodeDecodeError as e:
                        if e.reason == "unexpected end of data" and e.start > 0:
                            cut = e.start
            skip = 3 if offset == 0 and buf.startswith(_BOM) else 0
            text = _decode(buf[skip:cut], path, offset + skip)
            if text.strip():
                yield Document(text, str(path))
            if cut < PIECE_BYTES and cut == len(buf):
                return
            offset += cut
            buf = buf[cut:]


def read(path: Path, text_field: str, source_field: str) -> Iterator[Document]:
    """The documents of one input, by its kind (an empty text file has none)."""
    kind_ = kind(path)
    if kind_ == "dataset":
        return _read_dataset(path, text_field, source_field)
    if kind_ == "parquet":
        return _read_parquet(path, text_field, source_field)
    if not _check_text_file(path):
        return iter(())
    if kind_ == "text":
        return _read_text(path)
    return {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv}[kind_](path, text_field, source_field)
