"""Checkpoints: every piece of state, saved atomically with checksums, restored bit for bit.

A checkpoint is a folder `checkpoints/round-000006/` holding
- `state.safetensors`: every tensor of the nested state (parameters, optimizer moments, RNG
  states), keyed by its path in the state;
- `state.json`: the rest of the state (numbers, strings) with `{"__tensor__": key}` where a
  tensor stood and `{"__float__": "nan"}` (or "inf", "-inf") where a non-finite float stood, so
  any nested dict/list state round-trips exactly (int dict keys included) in strict JSON;
- `checksums.json`: sha256 of both files.

A process killed at any moment leaves a run that can be resumed from a valid checkpoint:
- `save` writes into a hidden `.tmp-round-N`, fsyncs every file and the folder, renames it into
  place and fsyncs `checkpoints/`; a `round-N` folder is therefore always complete.
- Re-saving an existing round (a round rerun after a resume) first moves the old folder aside to
  `.replaced-round-N`, renames the new one in, and only then deletes the old one; a process killed
  in between leaves `.replaced-round-N`, which the next `save`/`latest`/`latest_valid` renames
  back if `round-N` is missing.
- Pruning beyond the newest `keep` renames each folder to `.old-round-N`, fsyncs, then deletes it,
  so a half-deleted folder never looks like a checkpoint. Checkpoints of rounds after the one
  being saved are stale (left from before a resume that skipped them as corrupt) and go too.
- Leftover hidden folders of a killed process are cleaned up by the next `save`.
`latest_valid` skips a corrupt newest checkpoint (with a warning) and falls back to an older one.
Other files the run writes whole (config.json, summary.json, model.safetensors) go through
`atomic_write_text`, `atomic_write_json` and `atomic_save_safetensors`.
Tied weights (one tensor under two names, as Hugging Face models tie the output head to the
token embedding) are written once, under the first name; `diloco.model.init.with_tied` fills in the
others on load.
Every file gets the mode `open` gives a new file (the umask's), safetensors' 0600 included.

    diloco train --checkpoint-every 2 --rounds 4 && diloco train --resume runs/...
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from diloco.errors import UserError
from diloco.rundir.metrics import to_json

_NAME = re.compile(r"^round-(\d{6})$")
_HIDDEN = re.compile(r"^\.(tmp|old|replaced)-round-(\d{6})$")
_FILES = ("state.safetensors", "state.json")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def flatten(obj: Any, tensors: dict[str, torch.Tensor], path: str = "", seen: dict | None = None) -> Any:
    """Move tensors out of `obj` into `tensors`; return a strict-JSON-able skeleton. A tensor that
    is an earlier one (tied weights) is stored once: both places name the first one's key."""
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if (same := _same(obj)) in seen:
            return {"__tensor__": seen[same]}
        if same is not None:
            seen[same] = path
        tensors[path] = obj.detach().cpu().clone().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten(v, tensors, f"{path}.{k}", seen) for k, v in obj.items()}
        return {"__items__": [[k, flatten(v, tensors, f"{path}.{k}", seen)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [flatten(v, tensors, f"{path}.{i}", seen) for i, v in enumerate(obj)]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}  # 'nan', 'inf', '-inf'
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {path}")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__float__" in skeleton:
            return _NONFINITE[skeleton["__float__"]]
        if "__items__" in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton["__items__"]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make renames and deletions inside `path` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a whole file or nothing: write a temporary file, fsync it, rename it, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, *, indent: int | None = 2) -> None:
    """`atomic_write_text` of strict JSON: non-finite floats become null (metrics.to_json)."""
    atomic_write_text(path, to_json(obj, indent=indent) + "\n")


def _same(t: torch.Tensor) -> tuple | None:
    """What makes two tensors one (the same memory, seen the same way); None for an empty one."""
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def _save_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, leaving the file the mode `open` gives a new one (save_file makes it
    0600, readable by its owner only)."""
    with open(path, "wb"):
        pass
    mode = os.stat(path).st_mode & 0o777
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, mode)


def atomic_save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write a safetensors file whole or not at all (e.g. the run's model.safetensors): a
    temporary file in the same folder, fsync, os.replace, fsync the folder. A tensor that is an
    earlier one (tied weights) is written once, under the earlier name (see
    `diloco.model.init.with_tied`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    once: dict[str, torch.Tensor] = {}
    seen: set = set()
    for name, t in tensors.items():
        if (same := _same(t)) is None or same not in seen:
            once[name] = t.contiguous()
            seen.add(same)
    try:
        _save_file(once, tmp, metadata)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _round_dirs(checkpoint_dir: Path) -> dict[int, Path]:
    """round -> checkpoint folder, for the complete (visible) ones."""
    if not checkpoint_dir.is_dir():
        return {}
    found = {}
    for p in checkpoint_dir.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    return found


def _restore_replaced(checkpoint_dir: Path) -> None:
    """A process killed between moving round-N aside and renaming its replacement in leaves only
    `.replaced-round-N`, a complete checkpoint: put it back."""
    if not checkpoint_dir.is_dir():
        return
    restored = False
    for p in checkpoint_dir.iterdir():
        m = _HIDDEN.match(p.name)
        if m and m.group(1) == "replaced" and not (checkpoint_dir / f"round-{m.group(2)}").exists():
            os.rename(p, checkpoint_dir / f"round-{m.group(2)}")
            restored = True
    if restored:
        _fsync_dir(checkpoint_dir)


def _clean_leftovers(checkpoint_dir: Path) -> None:
    """Delete the hidden folders a killed `save` left behind (after restoring any replaced one)."""
    _restore_replaced(checkpoint_dir)
    for p in checkpoint_dir.iterdir():
        if _HIDDEN.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


def save(checkpoint_dir: Path, round_: int, state: dict[str, Any], *, keep: int | None = 3) -> Path:
    """Write the state for `round_` into checkpoint_dir/round-NNNNNN atomically and durably, then
    delete all but the newest `keep` checkpoints (None keeps all) and any of later rounds.

    Killed at any moment, this leaves checkpoint_dir with a complete checkpoint of `round_` or of
    the rounds it held before (see the module docstring)."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (or None), not {keep}")
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(checkpoint_dir)
    name = f"round-{round_:06d}"
    final = checkpoint_dir / name
    tmp = checkpoint_dir / f".tmp-{name}"
    tmp.mkdir()
    try:
        tensors: dict[str, torch.Tensor] = {}
        skeleton = flatten(state, tensors)
        _save_file(tensors, tmp / "state.safetensors")
        (tmp / "state.json").write_text(json.dumps(skeleton, allow_nan=False))
        sums = {f: _sha256(tmp / f) for f in _FILES}
        (tmp / "checksums.json").write_text(json.dumps(sums, indent=1))
        for f in (*_FILES, "checksums.json"):
            _fsync_file(tmp / f)
        _fsync_dir(tmp)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replaced = None
    if final.exists():  # a rerun of the same round after a resume: never delete before replacing
        replaced = checkpoint_dir / f".replaced-{name}"
        os.rename(final, replaced)
        _fsync_dir(checkpoint_dir)
    os.rename(tmp, final)
    _fsync_dir(checkpoint_dir)
    if replaced is not None:
        shutil.rmtree(replaced)
    _prune(checkpoint_dir, round_, keep)
    return final


def _prune(checkpoint_dir: Path, round_: int, keep: int | None) -> None:
    rounds = _round_dirs(checkpoint_dir)
    stale = [r for r in rounds if r > round_]
    older = sorted(r for r in rounds if r < round_)
    drop = stale + (older[: max(0, len(older) - (keep - 1))] if keep is not None else [])
    if not drop:
        return
    hidden = []
    for r in drop:
        old = checkpoint_dir / f".old-round-{r:06d}"
        os.rename(rounds[r], old)
        hidden.append(old)
    _fsync_dir(checkpoint_dir)
    for old in hidden:
        shutil.rmtree(old, ignore_errors=True)


def rounds(checkpoint_dir: Path) -> list[int]:
    """The rounds of the complete checkpoints, oldest first. It only reads (`latest` may put a
    replaced checkpoint back), so it can look into the folder of a run that is still saving."""
    return sorted(_round_dirs(Path(checkpoint_dir)))


def latest(checkpoint_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None (not verified: see `latest_valid`)."""
    checkpoint_dir = Path(checkpoint_dir)
    _restore_replaced(checkpoint_dir)
    rounds = _round_dirs(checkpoint_dir)
    return rounds[max(rounds)] if rounds else None


class _Corrupt(Exception):
    """Why a checkpoint cannot be read; `kind` is "corrupt" or "unreadable"."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def _read(path: Path) -> dict[str, Any]:
    try:
        sums = json.loads((path / "checksums.json").read_text())
        for name in _FILES:
            if _sha256(path / name) != sums[name]:
                raise _Corrupt("corrupt", f"{name} fails its checksum")
        tensors = load_file(str(path / "state.safetensors"))
        return unflatten(json.loads((path / "state.json").read_text()), tensors)
    except _Corrupt:
        raise
    except (OSError, KeyError, TypeError, ValueError, SafetensorError) as e:
        raise _Corrupt("unreadable", str(e) or type(e).__name__) from None


def load(path: Path) -> dict[str, Any]:
    """Read and verify a checkpoint; a damaged one is a UserError naming it."""
    try:
        return _read(Path(path))
    except _Corrupt as e:
        raise UserError(
            f"checkpoint {path} is {e.kind} ({e.reason}); "
            "delete that folder to resume from an earlier checkpoint."
        ) from None


def latest_valid(checkpoint_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and verifies, and its state; None if there is none.

    A corrupt or unreadable newer one is skipped with a warning on stderr naming it and the
    checkpoint resumed from instead; if every checkpoint is damaged, a UserError names the newest.
    """
    checkpoint_dir = Path(checkpoint_dir)
    _restore_replaced(checkpoint_dir)
    rounds = _round_dirs(checkpoint_dir)
    skipped: list[tuple[Path, _Corrupt]] = []
    for r in sorted(rounds, reverse=True):
        try:
            state = _read(rounds[r])
        except _Corrupt as e:
            skipped.append((rounds[r], e))
            continue
        for path, e in skipped:
            print(
                f"diloco: warning: checkpoint {path} is {e.kind} ({e.reason}); resuming from {rounds[r]}",
                file=sys.stderr,
            )
        return rounds[r], state
    if not skipped:
        return None
    path, e = skipped[0]
    raise UserError(
        f"checkpoint {path} is {e.kind} ({e.reason}) and no older one in {checkpoint_dir} is valid; "
        "delete that folder and start the run again without --resume."
    )
