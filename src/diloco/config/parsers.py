"""Pure parsers of settings written as text, shared by the config (which refuses bad values
before a run starts) and the components that use the values (clock, tokenizer, Hugging Face
models), so that both read the text one way.

    python -c "from diloco.config.parsers import parse_slowdown; print(parse_slowdown('2:4@100-200'))"
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from diloco.errors import UserError

# --tokenizer bpe:N: the special token, the 256 bytes and at least one merge; and an upper bound
BPE_MIN_VOCAB = 257 + 1
BPE_MAX_VOCAB = 1_000_000
# the weight files of a save_pretrained directory
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True)
class Slowdown:
    """Worker `worker` runs `factor` times slower while start_s <= t < end_s (simulated)."""

    worker: int
    factor: float
    start_s: float
    end_s: float


def parse_speeds(text: str) -> list[float]:
    """--speeds: positive seconds per step separated by commas; ValueError otherwise."""
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(text)
    return values


def parse_slowdown(text: str) -> Slowdown:
    """'W:FACTOR@START-END', e.g. '2:4@100-200': worker 2 is 4× slower from 100 s to 200 s."""
    worker, rest = text.split(":")
    factor, span = rest.split("@")
    start, end = span.split("-")
    return Slowdown(int(worker), float(factor), float(start), float(end))


def parse_worker_slowdown(text: str) -> tuple[float, float, float]:
    """`diloco worker --slowdown`: 'F' (always) or 'F@START-END' (from START to END seconds after
    the worker's first inner step; END may be inf) -> (F, START, END). ValueError if malformed."""
    factor, _, span = text.partition("@")
    start, end = span.split("-") if span else ("0", "inf")
    f, s, e = float(factor), float(start), float(end)
    if not (math.isfinite(f) and f >= 1 and math.isfinite(s) and 0 <= s < e):
        raise ValueError(text)
    return f, s, e


def parse_spec(spec: str) -> tuple[str, int | str | None]:
    """--tokenizer: 'byte' -> ('byte', None); 'bpe:N' -> ('bpe', N); anything else -> ('file', spec)."""
    if spec == "byte":
        return "byte", None
    if spec.startswith("bpe:"):
        n = spec[4:]
        if not n.strip().isdigit() or not BPE_MIN_VOCAB <= int(n) <= BPE_MAX_VOCAB:
            raise UserError(
                f"--tokenizer {spec!r}: the BPE vocabulary size must be a whole number from "
                f"{BPE_MIN_VOCAB} to {BPE_MAX_VOCAB:_}; use e.g. bpe:4096."
            )
        return "bpe", int(n)
    return "file", spec


def read_model_config(text_or_path: str, where: str | None = None) -> tuple[dict, str]:
    """A Hugging Face model config (--model-config) as a dict, from a JSON file's path or from JSON
    text ('{...'), and how messages name it. UserError if it is missing, not a JSON object or has
    no `model_type`; whether transformers can build it is checked where the model is built
    (diloco.model.hf.load_model_config)."""
    text_or_path = str(text_or_path)
    if text_or_path.lstrip().startswith("{"):
        where, text = where or "the model config text", text_or_path
    else:
        where = where or f"model config {text_or_path}"
        try:
            text = Path(text_or_path).read_text()
        except OSError as e:
            raise UserError(
                f"{where} cannot be read ({e.strerror or e}): give the path of a transformers config.json."
            ) from None
        except UnicodeDecodeError:
            raise UserError(f"{where} is not text: give the path of a transformers config.json.") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where} is not valid JSON ({e}): fix it, or give a transformers config.json."
        ) from None
    if not isinstance(config, dict):
        raise UserError(f"{where} is not a JSON object: give a transformers config.json, an object.")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UserError(f'{where} has no \'model_type\': add one, such as "llama", "gpt2" or "qwen2".')
    return config, where


def is_pretrained_dir(path: str | Path) -> bool:
    """Whether `path` is a save_pretrained directory: a config.json with 'model_type' and weights."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict)
        and isinstance(config.get("model_type"), str)
        and any((path / name).is_file() for name in WEIGHT_FILES)
    )
