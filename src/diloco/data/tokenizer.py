"""Tokenizers for `diloco train --tokenizer byte|bpe:N|PATH/tokenizer.json`.

- `byte`: UTF-8 bytes as ids 0..255 (vocabulary 256), lossless, no training, no end-of-text id.
- `bpe:N`: a GPT-2 style byte-level BPE of vocabulary N trained on the training text with
  Hugging Face `tokenizers` (all 256 bytes in its alphabet, so any text round-trips exactly;
  "<|endoftext|>" is id 0 and follows every document). The same text gives the same tokenizer.
- a path: a `tokenizer.json` made by `tokenizers` (or a directory holding one), used as it is;
  its end-of-text id is the first of `EOS_TOKENS` in its vocabulary, if any.

Every tokenizer has a `fingerprint` (a hex digest of its exact mapping) for checkpoints to
compare, saves itself next to a run (`save`), and `export_tokenizer` writes it so that
`transformers.AutoTokenizer.from_pretrained` gives the same ids. `tokenizers` and
`transformers` are imported only when needed.

    python -c "from diloco.data.tokenizer import train_bpe; t = train_bpe(['to be or not to be'] * 9, 260); \
print(t.encode_batch(['to be'])[0], t.decode(t.encode_batch(['to be'])[0]))"
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from diloco.config.parsers import BPE_MAX_VOCAB as BPE_MAX_VOCAB
from diloco.config.parsers import BPE_MIN_VOCAB as BPE_MIN_VOCAB
from diloco.config.parsers import parse_spec as parse_spec
from diloco.errors import UserError

EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")  # in order of preference
BPE_EOS = "<|endoftext|>"
_BYTE_FINGERPRINT = hashlib.blake2b(b"diloco byte tokenizer: UTF-8 bytes as ids 0..255").hexdigest()


class Tokenizer:
    """What a run needs from a tokenizer (see `ByteTokenizer`, `HFTokenizer`)."""

    vocab_size: int
    eos_id: int | None = None  # appended after every document when not None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """One integer array of ids per text, with no special tokens added."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A hex digest that identifies the exact mapping from text to ids."""
        raise NotImplementedError

    def save(self, directory: Path) -> Path | None:
        """Writes what loads this tokenizer again into `directory`; returns the file, if any."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: vocabulary 256, lossless, no training."""

    vocab_size = 256
    eos_id = None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode(), np.uint8) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(np.asarray(ids, dtype=np.int64).astype(np.uint8).tolist()).decode(errors="replace")

    def fingerprint(self) -> str:
        return _BYTE_FINGERPRINT

    def save(self, directory: Path) -> Path | None:
        return None


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer`; encodes batches on all cores (in Rust)."""

    def __init__(self, tok: Any):
        self.tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1  # ids may have gaps: the largest + 1
        self.eos_id = next((vocab[t] for t in EOS_TOKENS if t in vocab), None)
        self._encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._encode(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        return hashlib.blake2b(self.tok.to_str().encode()).hexdigest()

    def save(self, directory: Path) -> Path | None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "tokenizer.json"
        self.tok.save(str(path))
        return path


def _tokenizer_path(path: str | Path) -> Path:
    path = Path(path).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer_file(path: str | Path) -> HFTokenizer:
    """A `tokenizer.json` made by Hugging Face `tokenizers` (or a directory holding one)."""
    file = _tokenizer_path(path)
    if not file.is_file():
        raise UserError(
            f"tokenizer file {str(file)!r} does not exist; give --tokenizer byte, bpe:N or the path "
            "of a tokenizer.json saved by Hugging Face tokenizers."
        )
    try:
        text = file.read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(
            f"tokenizer file {str(file)!r} is not readable JSON ({e}); give the tokenizer.json saved "
            "by Hugging Face tokenizers."
        ) from None
    from tokenizers import Tokenizer as RustTokenizer

    try:
        tok = RustTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception
        raise UserError(
            f"tokenizer file {str(file)!r} is JSON but not a tokenizer Hugging Face tokenizers can load "
            f"({e}); give the tokenizer.json saved by tokenizers."
        ) from None
    return HFTokenizer(tok)


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style) of `vocab_size` tokens, "<|endoftext|>" as id 0.
    Deterministic. UserError if the text yields fewer (every word is one token before that).
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    trained = HFTokenizer(tok)
    if trained.vocab_size < vocab_size:
        raise UserError(
            f"the training text yields at most {trained.vocab_size} BPE tokens (every word is one "
            f"token by then), fewer than --tokenizer bpe:{vocab_size}; use bpe:{trained.vocab_size} "
            "or less, or more text."
        )
    return trained


def build_tokenizer(spec: str, train_texts: Callable[[], Iterable[str]]) -> Tokenizer:
    """The tokenizer of `--tokenizer spec`; `train_texts()` is called only for bpe:N."""
    kind, arg = parse_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return train_bpe(train_texts(), int(arg))  # type: ignore[arg-type]
    return load_tokenizer_file(spec)


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte, as `tokenizers`' ByteLevel uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_level_tokenizer() -> Any:
    """A `tokenizers.Tokenizer` whose ids are exactly UTF-8 bytes, as `ByteTokenizer`'s."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def export_tokenizer(tok: Tokenizer, out_dir: Path, *, model_max_length: int) -> None:
    """Writes `out_dir` so that `transformers.AutoTokenizer.from_pretrained` gives `tok`'s ids."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tok, HFTokenizer):
        rust = tok.tok
    elif isinstance(tok, ByteTokenizer):
        rust = _byte_level_tokenizer()
    else:
        raise TypeError(f"cannot export a {type(tok).__name__}")
    kwargs: dict[str, Any] = {}
    if tok.eos_id is not None:
        kwargs["eos_token"] = rust.id_to_token(tok.eos_id)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=rust,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
    fast.save_pretrained(str(out_dir))
    # transformers 5 names its own backend class, which 4.x does not know; both load this one
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))
