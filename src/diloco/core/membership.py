"""Which workers take part in a round: outer_grads lost on the way (`--drop-prob`, drawn the
same in every runtime) and workers coming and going (`--workers-schedule`).

    python -c "from diloco.core.membership import parse_workers_schedule as f; print(f('0:4,0.5:2', 4))"
"""

from __future__ import annotations

import random


def outer_grad_dropped(seed: int, round_: int, worker: int, prob: float) -> bool:
    """Whether worker's outer_grad of this round is lost (the DiLoCo paper's robustness test).
    Drawn from a stream keyed by (seed, round, worker), so every runtime agrees."""
    return prob > 0 and random.Random(f"drop/{seed}/{round_}/{worker}").random() < prob


def parse_workers_schedule(text: str, max_workers: int) -> list[tuple[float, int]]:
    """'0:4,0.5:8' -> [(0.0, 4), (0.5, 8)]: from each fraction of the rounds on, that many
    workers are active. Raises ValueError on anything else."""
    points = []
    for part in text.split(","):
        frac, n = part.split(":")
        points.append((float(frac), int(n)))
    fracs = [f for f, _ in points]
    if fracs[0] != 0 or fracs != sorted(set(fracs)) or fracs[-1] >= 1:
        raise ValueError(text)
    if not all(1 <= n <= max_workers for _, n in points):
        raise ValueError(text)
    return points


def active_workers(schedule: list[tuple[float, int]], round_: int, rounds: int) -> int:
    """Workers active in 0-based round `round_` of `rounds` under a parsed schedule."""
    progress = round_ / rounds
    return [n for frac, n in schedule if frac <= progress][-1]
