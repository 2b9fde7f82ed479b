"""Checkpoints: every piece of state, saved atomically with checksums, restored bit for bit.

A checkpoint is a folder `checkpoints/round-000006/` holding
- `state.safetensors`: every tensor of the nested state (parameters, optimizer moments, RNG
  states), keyed by its path in the state;
- `state.json`: the rest of the state (numbers, strings) with `{"__tensor__": key}` where a
  tensor stood, so any nested dict/list state round-trips exactly (int dict keys included);
- `checksums.json`: sha256 of both files.
It is written under a temporary name and renamed into place, so a crash leaves either the whole
checkpoint or none.

    diloco train --checkpoint-every 2 --rounds 4 && diloco train --resume runs/...
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from diloco.errors import UserError

_NAME = re.compile(r"^round-(\d{6})$")


def flatten(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """Move tensors out of `obj` into `tensors`; return a JSON-able skeleton."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().clone().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        return {"__items__": [[k, flatten(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [flatten(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {path}")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__items__" in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton["__items__"]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write a whole file or nothing: write a temporary file, fsync it, rename it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(checkpoint_dir: Path, round_: int, state: dict[str, Any]) -> Path:
    """Write the state for `round_` into checkpoint_dir/round-NNNNNN atomically."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / f"round-{round_:06d}"
    tmp = checkpoint_dir / f".tmp-round-{round_:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(state, tensors)
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "state.json").write_text(json.dumps(skeleton))
    sums = {name: _sha256(tmp / name) for name in ("state.safetensors", "state.json")}
    (tmp / "checksums.json").write_text(json.dumps(sums, indent=1))
    for name in ("state.safetensors", "state.json", "checksums.json"):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():  # a rerun of the same round after a resume
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def latest(checkpoint_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    if not checkpoint_dir.is_dir():
        return None
    found = sorted(p for p in checkpoint_dir.iterdir() if _NAME.match(p.name) and p.is_dir())
    return found[-1] if found else None


def load(path: Path) -> dict[str, Any]:
    """Read and verify a checkpoint; a damaged one is a UserError naming it."""
    try:
        sums = json.loads((path / "checksums.json").read_text())
        for name in ("state.safetensors", "state.json"):
            if _sha256(path / name) != sums[name]:
                raise UserError(
                    f"checkpoint {path} is corrupt ({name} fails its checksum); "
                    "delete that folder to resume from an earlier checkpoint."
                )
        tensors = load_file(str(path / "state.safetensors"))
        return unflatten(json.loads((path / "state.json").read_text()), tensors)
    except (OSError, KeyError, ValueError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(
            f"checkpoint {path} is unreadable ({e}); delete that folder to resume from an earlier checkpoint."
        ) from None
