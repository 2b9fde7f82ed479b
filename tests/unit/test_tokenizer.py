"""Tokenizers: the byte tokenizer gives the old UTF-8 ids; a trained BPE has the asked vocabulary,
round-trips any text exactly, is deterministic and ends documents with id 0; files save, load and
fail with the file's name; exports load in transformers with the same ids and decoding."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from diloco.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    bytes_to_unicode,
    export_tokenizer,
    load_tokenizer_file,
    parse_spec,
    train_bpe,
)
from diloco.errors import UserError

# newlines, runs of spaces, leading spaces, tabs, CRLF, punctuation after spaces, accents, CJK, emoji
TRICKY = [
    "To be, or not to be: that is the question.",
    "  two leading spaces\nand a newline\n\n\nthree more\n",
    " one leading space , then spaces before punctuation . ? !",
    "tabs\tand\r\nCRLF\r\n  \t mixed   ",
    "Héllo wörld, naïve façade — “quotes” ‘and’ ellipsis…",
    "日本語のテキスト 中文 한국어 Ελληνικά кириллица",
    "emoji 🎭🗡️👑 and a ZWJ family 👨‍👩‍👧",
    "",
    " ",
    "\n",
]


def _corpus(n_docs=300, seed=0):
    """Pseudo-words from syllables, with capitals, punctuation, newlines and some unicode."""
    rng = random.Random(seed)
    syll = ["th", "e", "an", "ing", "or", "qu", "st", "ea", "ou", "er", "ñ", "ö", "é", "日", "本", "x", "z"]
    docs = []
    for _ in range(n_docs):
        words = []
        for _ in range(rng.randint(20, 80)):
            w = "".join(rng.choice(syll) for _ in range(rng.randint(1, 4)))
            words.append(w.capitalize() if rng.random() < 0.1 else w)
            if rng.random() < 0.1:
                words.append(rng.choice([",", ".", "!", "\n", "\n\n", "  "]))
        docs.append(" ".join(words))
    return docs


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(_corpus(), 400)


def _ids(tok, text):
    return tok.encode_batch([text])[0].tolist()


class _OldByteTokenizer:
    """diloco.data.ByteTokenizer as it was before this module, verbatim."""

    def encode(self, text):
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()

    def decode(self, ids):
        return bytes(ids.to(torch.uint8).tolist()).decode(errors="replace")


def test_byte_ids_are_utf8_bytes_as_the_old_data_tokenizer_gave(tmp_path):
    tok, old = ByteTokenizer(), _OldByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.save(tmp_path)) == (256, None, None)
    for text in TRICKY:
        ids = _ids(tok, text)
        assert ids == list(text.encode())
        assert tok.decode(ids) == text
        if text:  # the old one failed on empty text (torch.frombuffer refuses an empty buffer)
            assert ids == old.encode(text).tolist()
            assert tok.decode(ids) == old.decode(torch.tensor(ids))
    assert tok.decode([0xE6, 0x97]) == old.decode(torch.tensor([0xE6, 0x97])) == "\ufffd"  # a cut character
    assert tok.decode(np.array([104, 105], np.uint8)) == "hi"
    assert tok.fingerprint() == ByteTokenizer().fingerprint()


def test_bpe_has_the_vocabulary_asked_and_eos_zero(bpe):
    assert bpe.vocab_size == 400
    assert bpe.eos_id == 0 and bpe.tok.id_to_token(0) == "<|endoftext|>"
    assert all(bpe.tok.token_to_id(ch) is not None for ch in bytes_to_unicode().values())  # every byte
    text = " ".join(_corpus(5, seed=1))
    assert len(_ids(bpe, text)) < 0.6 * len(text.encode())  # merges happen


def test_bpe_round_trips_any_text_exactly(bpe):
    for text in [*TRICKY, *_corpus(5, seed=2), "".join(TRICKY)]:
        ids = _ids(bpe, text)
        assert 0 not in ids and all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text, repr(text)
    assert bpe.decode([*_ids(bpe, "the end"), 0]) == "the end<|endoftext|>"


def test_bpe_training_is_deterministic_and_depends_on_the_text(bpe):
    again = train_bpe(_corpus(), 400)
    assert again.tok.to_str() == bpe.tok.to_str()
    assert again.fingerprint() == bpe.fingerprint()
    other = train_bpe(_corpus(seed=5), 400)
    assert other.fingerprint() != bpe.fingerprint()
    assert bpe.fingerprint() != ByteTokenizer().fingerprint()


def test_encode_batch_equals_encoding_one_by_one(bpe):
    texts = [*_corpus(200, seed=3), *TRICKY]
    for tok in (bpe, ByteTokenizer()):
        batch = tok.encode_batch(texts)
        assert len(batch) == len(texts)
        for text, ids in zip(texts, batch):
            assert isinstance(ids, np.ndarray) and np.issubdtype(ids.dtype, np.integer)
            assert ids.tolist() == _ids(tok, text)
    assert bpe.encode_batch([]) == []


def test_a_saved_tokenizer_loads_as_the_same(bpe, tmp_path):
    path = bpe.save(tmp_path / "run")
    assert path == tmp_path / "run" / "tokenizer.json" and path.is_file()
    for source in (path, str(path), tmp_path / "run"):  # the file, as text, or its directory
        loaded = load_tokenizer_file(source)
        assert isinstance(loaded, HFTokenizer)
        assert (loaded.vocab_size, loaded.eos_id) == (400, 0)
        assert loaded.fingerprint() == bpe.fingerprint()
        texts = [*TRICKY, *_corpus(20, seed=4)]
        assert [a.tolist() for a in loaded.encode_batch(texts)] == [_ids(bpe, t) for t in texts]


def test_eos_is_the_first_known_end_token_or_none(tmp_path):
    from tokenizers import Tokenizer, models

    def make(vocab):
        path = tmp_path / f"{len(vocab)}.json"
        Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="a")).save(str(path))
        return load_tokenizer_file(path)

    # preference: "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", whatever their ids
    assert make(["a", "</s>", "<|endoftext|>"]).eos_id == 2
    assert make(["a", "<eos>", "</s>", "b"]).eos_id == 2
    assert make(["a", "<|end_of_text|>", "<eos>"]).eos_id == 2
    assert make(["a", "b", "c", "<|end_of_text|>"]).eos_id == 3
    assert make(["a", "b"]).eos_id is None


def test_parse_spec():
    assert parse_spec("byte") == ("byte", None)
    assert parse_spec("bpe:4096") == ("bpe", 4096)
    assert parse_spec("bpe:258") == ("bpe", 258)
    assert parse_spec("bpe:1000000") == ("bpe", 1_000_000)
    assert parse_spec("runs/a/tokenizer.json") == ("file", "runs/a/tokenizer.json")
    for bad in ("bpe:abc", "bpe:10", "bpe:257", "bpe:-300", "bpe:", "bpe:4096.0", "bpe:1000001"):
        with pytest.raises(UserError, match="bpe:4096"):
            parse_spec(bad)


def test_bad_tokenizer_files_are_named(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(UserError, match="missing.json.*does not exist"):
        load_tokenizer_file(missing)
    not_json = tmp_path / "notjson.json"
    not_json.write_text("this is not JSON {")
    with pytest.raises(UserError, match="notjson.json.*not readable JSON"):
        load_tokenizer_file(not_json)
    for i, content in enumerate(({"a": 1}, [1, 2], {})):
        other = tmp_path / f"other{i}.json"
        other.write_text(json.dumps(content))
        with pytest.raises(UserError, match=f"other{i}.json.*not a tokenizer"):
            load_tokenizer_file(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty.*tokenizer.json.*does not exist"):
        load_tokenizer_file(tmp_path / "empty")


def test_build_tokenizer(bpe, tmp_path):
    def never():
        raise AssertionError("byte and file tokenizers are not trained")

    assert isinstance(build_tokenizer("byte", never), ByteTokenizer)
    built = build_tokenizer("bpe:400", lambda: iter(_corpus()))
    assert built.fingerprint() == bpe.fingerprint()
    path = bpe.save(tmp_path)
    assert build_tokenizer(str(path), never).fingerprint() == bpe.fingerprint()
    with pytest.raises(UserError):
        build_tokenizer("bpe:12", never)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_export_loads_in_transformers_with_the_same_ids(kind, bpe, tmp_path):
    from transformers import AutoTokenizer

    tok = ByteTokenizer() if kind == "byte" else bpe
    export_tokenizer(tok, tmp_path, model_max_length=512)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.is_fast and hf.model_max_length == 512 and len(hf) == tok.vocab_size
    assert hf.eos_token_id == tok.eos_id
    for text in [*TRICKY, *_corpus(10, seed=6)]:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == _ids(tok, text), repr(text)
        assert hf.decode(ids) == tok.decode(ids) == text, repr(text)


def test_importing_the_module_stays_light():
    heavy = "{'tokenizers', 'transformers'}"
    code = f"import sys, diloco.data.tokenizer; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_vocabulary_with_gaps_counts_up_to_its_largest_id(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    tok = RustTokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "b": 300}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer_file(tmp_path / "tokenizer.json")
    assert loaded.vocab_size == 301  # ids 0..300, not the 3 entries
    assert loaded.encode_batch(["a b"])[0].tolist() == [0, 300]


def test_a_bpe_larger_than_the_text_yields_is_refused():
    with pytest.raises(UserError, match=r"yields at most \d+ BPE tokens .* fewer than --tokenizer bpe:1000"):
        train_bpe(["to be or not to be, that is the question"] * 9, 1000)
