import csv
import functools
import json
import shutil

import pytest

from diloco.data import formats
from diloco.data.formats import Document
from diloco.data.sources import expand, fingerprint, read_documents
from diloco.errors import UserError


def docs(paths, **kw):
    return list(read_documents(paths, **kw))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=2)
    return path


def save_dataset(path, columns, split=None):
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict(columns)
    if split is None:
        ds.save_to_disk(str(path))
    else:
        datasets.DatasetDict({s: ds for s in split}).save_to_disk(str(path))
    return path


def error(paths, **kw) -> str:
    with pytest.raises(UserError) as info:
        docs(paths, **kw)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# plain text and folders


def test_plain_text_is_one_document_with_its_path_as_source(tmp_path):
    path = tmp_path / "notes.md"
    path.write_bytes(b"\xef\xbb\xbfline one\n\nline two\xc3\xa9\n")  # a BOM, dropped
    assert docs([path]) == [Document("line one\n\nline two\u00e9\n", str(path))]
    assert docs([str(path)], source_field="ignored") == [Document("line one\n\nline two\u00e9\n", str(path))]


def test_folders_are_walked_sorted_skipping_hidden_files_and_folders(tmp_path):
    (tmp_path / "b" / "c").mkdir(parents=True)
    (tmp_path / ".git").mkdir()
    for name in ["z.txt", "b/c/deep.txt", "b/a.TXT", "a", ".hidden.txt", ".git/config", "b/c/.x"]:
        (tmp_path / name).write_text(f"text of {name}\n")
    expected = [tmp_path / "a", tmp_path / "b/a.TXT", tmp_path / "b/c/deep.txt", tmp_path / "z.txt"]
    assert expand([tmp_path]) == expected
    assert [d.source for d in docs([tmp_path])] == [str(p) for p in expected]
    assert docs([tmp_path])[2].text == "text of b/c/deep.txt\n"
    # files given are kept in the order given, before or after folders
    assert expand([tmp_path / "z.txt", tmp_path / "b" / "c"]) == [
        tmp_path / "z.txt",
        tmp_path / "b/c/deep.txt",
    ]


def test_missing_path_and_empty_folders_are_refused(tmp_path):
    assert "nope.txt does not exist; check the path given to --data" in error([tmp_path / "nope.txt"])
    (tmp_path / "empty").mkdir()
    assert "empty holds no files" in error([tmp_path / "empty"])
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / ".only").write_text("x")
    assert "hidden holds no files" in error([tmp_path / "hidden"])


def test_empty_blank_binary_and_non_utf8_files_are_refused(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    assert "empty.txt has no text;" in error([tmp_path / "empty.txt"])
    (tmp_path / "blank.txt").write_text(" \n\t\n")
    assert "blank.txt has no text;" in error([tmp_path / "blank.txt"])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert "empty.jsonl has no text;" in error([tmp_path / "empty.jsonl"])
    (tmp_path / "model.bin").write_bytes(b"abc\x00def")
    assert "model.bin is a binary file, not text;" in error([tmp_path / "model.bin"])
    (tmp_path / "data.jsonl").write_bytes(b'{"text": "a"}\n\x00')
    assert "data.jsonl is a binary file" in error([tmp_path / "data.jsonl"])
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 ok".encode("latin-1"))
    message = error([tmp_path / "latin1.txt"])
    assert "latin1.txt is not UTF-8 text (invalid byte at offset 3); convert it to UTF-8" in message
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert "latin1.jsonl is not UTF-8 text (invalid byte at offset 28)" in error([tmp_path / "latin1.jsonl"])


def test_documents_are_streamed_file_by_file(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.bin").write_bytes(b"\x00")
    it = read_documents([tmp_path])
    assert next(it) == Document("first", str(tmp_path / "a.txt"))  # before b.bin is read
    with pytest.raises(UserError, match="b.bin is a binary file"):
        next(it)


def test_big_plain_files_come_in_pieces_that_end_at_newlines(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "BIG_FILE_BYTES", 200)
    monkeypatch.setattr(formats, "PIECE_BYTES", 64)
    text = "".join(f"line {i} " + "\u00e9" * (i % 13) + "\n" for i in range(60)) + "no newline at the end"
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    pieces = docs([path])
    assert len(pieces) > 10
    assert all(p.source == str(path) for p in pieces)
    assert all(p.text.endswith("\n") for p in pieces[:-1])
    assert all(len(p.text.encode()) <= 64 for p in pieces)
    assert "".join(p.text for p in pieces) == text
    # a file with no newline at all is cut between characters, never inside one
    path.write_text("\u00e9\u20ac" * 100, encoding="utf-8")
    pieces = docs([path])
    assert len(pieces) > 4 and "".join(p.text for p in pieces) == "\u00e9\u20ac" * 100
    # the offset of a bad byte counts from the start of the file, not of the piece
    path.write_bytes(b"abc\n" * 40 + b"\xff")
    assert "big.txt is not UTF-8 text (invalid byte at offset 160)" in error([path])


# JSON Lines and JSON


def test_jsonl_documents_skip_blank_lines_and_empty_texts(tmp_path):
    path = tmp_path / "data.JSONL"
    path.write_text('{"text": "one", "id": 1}\n\n   \n{"text": "  "}\n{"text": "two\\nlines"}\n')
    assert docs([path]) == [Document("one", str(path)), Document("two\nlines", str(path))]


def test_jsonl_text_and_source_fields(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"body": "a", "site": "x.org"}, {"body": "b", "site": 7}, {"body": "c", "site": "x.org"}],
    )
    assert docs([path], text_field="body", source_field="site") == [
        Document("a", "x.org"),
        Document("b", "7"),
        Document("c", "x.org"),
    ]
    write_jsonl(path, [{"body": "a", "site": "x"}, {"body": "b"}])
    message = error([path], text_field="body", source_field="site")
    assert 'd.jsonl:2 has no "site" field' in message and "--source-field" in message


@pytest.mark.parametrize(
    "line, expected",
    [
        ("{not json}", "bad.jsonl:2 is not valid JSON"),
        ('["a list"]', "bad.jsonl:2 is a JSON array, not an object"),
        ('"a string"', "bad.jsonl:2 is a JSON string, not an object"),
        ('{"content": "x", "id": 3}', 'bad.jsonl:2 has no "text" field (its fields: "content", "id")'),
        ('{"text": 5}', 'bad.jsonl:2: the "text" field is a number, not a string'),
        ('{"text": null}', 'bad.jsonl:2: the "text" field is a null, not a string'),
    ],
)
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    message = error([path])
    assert expected in message
    assert "--text-field" in message or "one JSON object" in message


def test_json_array_and_json_lines_in_a_json_file(tmp_path):
    array = tmp_path / "array.json"
    array.write_text('  \n[{"text": "a", "s": 1},\n {"text": ""},\n {"text": "b", "s": 2}]')
    assert docs([array], source_field="s") == [Document("a", "1"), Document("b", "2")]
    lines = write_jsonl(tmp_path / "lines.json", [{"text": "a"}, {"text": "b"}])
    assert [d.text for d in docs([lines])] == ["a", "b"]
    array.write_text('[{"text": "a"},\n {"title": "b"}]')
    assert 'array.json item 1 has no "text" field (its fields: "title")' in error([array])
    array.write_text('[{"text": "a"},\n {"text": }]')
    assert "array.json:2 is not valid JSON" in error([array])
    array.write_text('[{"text": ""}]')
    assert 'array.json has no text in its "text" field' in error([array])


# CSV


def test_csv_with_quoted_newlines_commas_and_crlf(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(
        b'id,text,src\r\n1,"first line\r\nsecond, with comma\r\n",a\r\n2,"say ""hi""",b\r\n'
        b"3,,c\r\n4,plain,a\r\n"
    )
    assert docs([path], source_field="src") == [
        Document("first line\r\nsecond, with comma\r\n", "a"),
        Document('say "hi"', "b"),
        Document("plain", "a"),
    ]
    assert [d.source for d in docs([path])] == [str(path)] * 3


def test_csv_fields_larger_than_the_default_limit(tmp_path):
    path = tmp_path / "big.csv"
    path.write_text('text\n"' + "x" * 200_000 + '"\n')
    assert docs([path])[0].text == "x" * 200_000


def test_bad_csv_files(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,body\n1,hello\n")
    message = error([path])
    assert 't.csv has no "text" column (its columns: "id", "body")' in message and "--text-field" in message
    assert docs([path], text_field="body") == [Document("hello", str(path))]
    assert 't.csv has no "src" column' in error([path], text_field="body", source_field="src")
    path.write_text("text,src\nhello,a\nworld\n")
    assert 't.csv:3 has no "src" value' in error([path], source_field="src")
    path.write_text("text\n")
    assert 't.csv has no text in its "text" field' in error([path])


def test_csv_errors_and_old_mac_line_ends(tmp_path, monkeypatch):
    path = tmp_path / "mac.csv"
    path.write_bytes(b'text,src\r"a\rb",x\rc,y\r')
    assert docs([path], source_field="src") == [Document("a\rb", "x"), Document("c", "y")]
    strict = functools.partial(csv.DictReader, strict=True)
    monkeypatch.setattr(csv, "DictReader", strict)  # lenient csv hardly ever raises csv.Error
    path.write_text('text\nok\n"a"b\n')
    assert "mac.csv:3 is not valid CSV" in error([path])


# parquet


def test_parquet_columns_batches_and_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "BATCH_ROWS", 2)
    path = write_parquet(
        tmp_path / "d.Parquet",
        {"body": ["a", None, "", "b", "c"], "site": ["x", "y", "z", "w", "v"], "n": [1, 2, 3, 4, 5]},
    )
    assert docs([path], text_field="body") == [Document(t, str(path)) for t in "abc"]
    assert docs([path], text_field="body", source_field="n") == [
        Document("a", "1"),
        Document("b", "4"),
        Document("c", "5"),
    ]
    message = error([path])
    assert 'd.Parquet has no "text" column (its columns: "body", "site", "n")' in message
    assert "--text-field" in message
    assert 'd.Parquet: the "n" column holds int64, not text' in error([path], text_field="n")


def test_parquet_missing_source_values_and_unreadable_files(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", {"text": ["a", "b"], "site": ["x", None]})
    assert 'd.parquet row 1 has no "site" value' in error([path], source_field="site")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet at all, just some bytes")
    assert "bad.parquet is not a parquet file pyarrow can read" in error([bad])
    truncated = tmp_path / "cut.parquet"
    truncated.write_bytes(path.read_bytes()[:-20])
    assert "cut.parquet is not a parquet file pyarrow can read" in error([truncated])


# datasets' save_to_disk folders


def test_saved_dataset_is_one_input_and_read_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "BATCH_ROWS", 2)
    folder = save_dataset(
        tmp_path / "data" / "ds", {"text": ["a", " ", "b", "c", "d"], "site": ["x", "y", "x", "z", "x"]}
    )
    (tmp_path / "data" / "zz.txt").write_text("after")
    assert expand([tmp_path / "data"]) == [folder, tmp_path / "data" / "zz.txt"]
    assert expand([folder]) == [folder]
    assert docs([tmp_path / "data"]) == [Document(t, str(folder)) for t in "abcd"] + [
        Document("after", str(tmp_path / "data" / "zz.txt"))
    ]
    assert [d.source for d in docs([folder], source_field="site")] == ["x", "x", "z", "x"]
    message = error([folder], text_field="body")
    assert 'ds has no "body" column (its columns: "text", "site")' in message and "--text-field" in message


def test_dataset_dict_uses_its_train_split(tmp_path):
    both = save_dataset(tmp_path / "both", {"text": ["t1", "t2"]}, split=["validation", "train"])
    assert docs([both]) == [Document("t1", str(both)), Document("t2", str(both))]
    val = save_dataset(tmp_path / "val", {"text": ["v"]}, split=["validation", "test"])
    message = error([val])
    assert 'val has no "train" split (its splits: "validation", "test")' in message


def test_broken_saved_datasets_are_refused(tmp_path):
    folder = save_dataset(tmp_path / "ds", {"text": ["a"], "n": [1]})
    assert 'ds: the "n" column holds Value' in error([folder], text_field="n")
    (folder / "state.json").write_text("{")
    assert "ds could not be loaded by datasets.load_from_disk" in error([folder])
    folder = save_dataset(tmp_path / "ds2", {"text": ["a"]})
    for arrow in folder.glob("*.arrow"):
        arrow.write_bytes(b"junk")
    assert "ds2 could not be loaded by datasets.load_from_disk" in error([folder])


# fingerprint


def test_fingerprint_follows_bytes_files_and_fields(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("hello world\n")
    write_jsonl(data / "sub" / "b.jsonl", [{"text": "x", "s": "1"}])
    base = fingerprint([data])
    assert len(base) == 32 and int(base, 16) >= 0
    assert fingerprint([data]) == base
    assert fingerprint([str(data)]) == base
    moved = tmp_path / "elsewhere" / "data"
    shutil.copytree(data, moved)
    assert fingerprint([moved]) == base  # names are relative to the paths given
    (data / ".hidden").write_text("not an input")
    assert fingerprint([data]) == base

    assert fingerprint([data], text_field="body") != base
    assert fingerprint([data], source_field="s") != base
    (data / "a.txt").write_text("hello World\n")  # one byte, same size
    assert fingerprint([data]) != base
    (data / "a.txt").write_text("hello world\n")
    assert fingerprint([data]) == base
    (data / "c.txt").write_text("")
    assert fingerprint([data]) != base
    (data / "c.txt").unlink()
    (data / "sub" / "b.jsonl").rename(data / "sub" / "c.jsonl")
    assert fingerprint([data]) != base


def test_fingerprint_covers_every_file_of_a_saved_dataset(tmp_path):
    folder = save_dataset(tmp_path / "ds", {"text": ["a", "b"]})
    base = fingerprint([folder])
    assert fingerprint([folder]) == base
    arrow = next(folder.glob("*.arrow"))
    blob = bytearray(arrow.read_bytes())
    i = blob.rindex(b"b")
    blob[i : i + 1] = b"c"
    arrow.write_bytes(bytes(blob))
    assert docs([folder])[1].text == "c"
    assert fingerprint([folder]) != base
    with pytest.raises(UserError, match="missing does not exist"):
        fingerprint([tmp_path / "missing"])


def test_a_lone_surrogate_escape_is_refused_with_its_line(tmp_path):
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "hello \\ud800 world"}\n')
    with pytest.raises(UserError, match=r"s.jsonl:2.*not a Unicode character"):
        list(read_documents([tmp_path / "s.jsonl"]))
