"""DistributedDiLoCo's (distributed.py) checks of its arguments and its small helpers: the
Streaming DiLoCo schedule it is given, the fingerprint its processes compare, the CPU copy of
the model that holds θ_global."""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any

import torch
import torch.nn as nn

from diloco.core.outer import OuterOpt
from diloco.core.outer_side import ON_NONFINITE
from diloco.core.streaming import Schedule


def _check_arguments(
    model: nn.Module, inner_steps: int, outer_opt, bucket_mb: float, on_nonfinite: str
) -> None:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "pass the model itself, not wrapped in DistributedDataParallel: data parallel across the "
            "workers would average their gradients every step (for a worker of several processes, "
            "build DistributedDiLoCo with procs_per_worker first, then wrap over outer.worker_group)"
        )
    if inner_steps < 1:
        raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
    if outer_opt is not None and not isinstance(outer_opt, OuterOpt):
        raise ValueError(
            f"outer_opt must be an OuterOpt (Nesterov, SGD, Adam), got {type(outer_opt).__name__}"
        )
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")


def _schedule(
    H: int, fragments: int, overlap_steps: int, mix_alpha: float, on_nonfinite: str
) -> Schedule | None:
    """Streaming DiLoCo's schedule, None for plain DiLoCo; what it cannot do is refused here."""
    if fragments == 1 and overlap_steps == 0:
        return None
    if fragments < 1 or overlap_steps < 0:
        raise ValueError(
            f"fragments must be at least 1 and overlap_steps at least 0, got {fragments} and {overlap_steps}"
        )
    if on_nonfinite != "stop":
        raise ValueError(
            "Streaming DiLoCo (fragments > 1 or overlap_steps > 0) stops on a NaN: leave on_nonfinite "
            "at 'stop'"
        )
    if not 0.0 <= mix_alpha < 1.0:
        raise ValueError(
            f"mix_alpha must lie in [0, 1), got {mix_alpha}: the weight of a worker's own parameters in "
            "a merge (at 1 it would never take θ_global)"
        )
    try:
        return Schedule(H, fragments, overlap_steps, mix_alpha)
    except Exception as e:  # its messages name the command line's flags: named as arguments here
        text = re.sub(r" \(--[a-z-]+\)", "", str(e))
        for flag, arg in (("--fragments ", "fragments="), ("--overlap-steps ", "overlap_steps=")):
            text = text.replace(flag, arg)
        raise ValueError(text.replace("--inner-steps", "inner_steps")) from None


def _digest(tensors: list[torch.Tensor]) -> int:
    """A fingerprint of the tensors' bytes (7 bytes of their SHA-256: fits an int64)."""
    digest = hashlib.sha256()
    for t in tensors:  # hashed in place, without a copy of the bytes (but a GPU tensor's)
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return int.from_bytes(digest.digest()[:7], "big")


def _cpu_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers live on the CPU, made without a second
    copy on the model's own device."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().cpu().clone(), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().cpu().clone()
    return copy.deepcopy(model, memo)
