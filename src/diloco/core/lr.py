"""Learning-rate schedules driven by a worker's own step count (docs/method.md §1-2).

    python -c "from diloco.core.lr import warmup_cosine as f; print(f(10, lr=1e-3, \
warmup_steps=10, total_steps=100, min_lr_ratio=0.1))"
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The lr for 0-based `step`: linear warm-up to `lr`, then cosine down to `lr * min_lr_ratio`.

    Warm-up counts from 1 so the first step already moves. Past `total_steps` the lr stays at
    the floor, which is > 0, so a worker that overruns its plan keeps learning.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    lr_min = lr * min_lr_ratio
    return lr_min + 0.5 * (lr - lr_min) * (1.0 + math.cos(math.pi * progress))
