"""Streaming DiLoCo (docs/method.md §3): fragments synced at staggered steps, with overlap.

The model's blocks are split into P fragments, strided as in the paper (block b goes to fragment
b mod P); parameters before the first block (embeddings) join fragment 0 and those after the
last one (the final norm) fragment P − 1. Each fragment syncs once per round of H inner steps,
at its own step, so the bytes sent at any moment are about 1/P of the model's.

With overlap τ, fragment p's exchange starts at step S_p = M_p − τ and the worker goes on for τ
steps; at M_p = ⌊(p + 1)·H / P⌋ the result is merged: θ_frag ← α·θ_local + (1 − α)·θ_global
(`--mix-alpha`; without overlap the fragment is replaced). The last fragment merges at H, so
a round ends with every fragment merged and nothing in flight: checkpoints, evaluations and
the round counters mean what they mean in plain DiLoCo, and P = 1 with τ = 0 is plain DiLoCo
exactly (tests/unit/test_streaming.py). A fragment's outer_grad is θ_global − θ_local on that
fragment, where θ_global is what the worker last merged; each fragment has its own outer
optimizer (`outer.Fragmented`).

A round is a list of `Segment`s, each "merge a fragment, run some steps, send a fragment"; the
simulator and the collective runtime run the same segments, so they compute the same numbers.

    diloco train --fragments 2 --overlap-steps 5 --codec fp4 --error-feedback
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.nn as nn

from diloco.errors import UserError

_BLOCK = re.compile(r"(?:^|\.)(\d+)\.")


def fragment_groups(model: nn.Module, fragments: int) -> list[list[int]]:
    """Indices (into the trainable parameters) of each of the P fragments: numbered blocks
    (`blocks.3.…`, `layers.3.…`, `h.3.…`) strided over the fragments; what comes before the first
    block joins fragment 0, what comes after the last one fragment P − 1."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    blocks = [int(m.group(1)) if (m := _BLOCK.search(n)) else None for n in names]
    numbered = sorted({b for b in blocks if b is not None})
    if fragments > len(numbered):
        raise ValueError(
            f"{fragments} fragments need at least as many numbered blocks, the model has {len(numbered)}"
        )
    rank = {b: i for i, b in enumerate(numbered)}
    groups: list[list[int]] = [[] for _ in range(fragments)]
    seen_block = False
    for i, b in enumerate(blocks):
        if b is None:
            groups[fragments - 1 if seen_block else 0].append(i)
        else:
            seen_block = True
            groups[rank[b] % fragments].append(i)
    return groups


@dataclass
class Segment:
    """Part of a round, for every worker: merge fragment `merge` (if any), run `steps` inner
    steps, then send fragment `send`'s outer_grad (if any)."""

    merge: int | None = None
    steps: int = 0
    send: int | None = None


@dataclass(frozen=True)
class Schedule:
    """When each fragment syncs within a round of H inner steps (module docstring)."""

    inner_steps: int
    fragments: int = 1
    overlap_steps: int = 0
    mix_alpha: float = 0.5

    def __post_init__(self) -> None:
        """The one check of H, P and τ (diloco.config's validation builds the schedule too): a
        UserError naming the flags, since a config's bad values end here."""
        H, P, tau = self.inner_steps, self.fragments, self.overlap_steps
        if P < 1 or tau < 0:
            raise ValueError(f"a streaming schedule needs P >= 1 and τ >= 0, got P={P} τ={tau}")
        if P > H:
            raise UserError(
                f"fragments (--fragments) {P} is more than inner_steps (--inner-steps) {H}, and each "
                f"fragment is sent at an inner step of its own: use --fragments {H} or fewer, or raise "
                "--inner-steps."
            )
        if H // P - tau < 1:
            raise UserError(
                f"overlap_steps (--overlap-steps) {tau} must be below inner_steps / fragments = {H // P} "
                "(each fragment's exchange must finish before the next one starts): use "
                f"--overlap-steps {H // P - 1} or fewer, or raise --inner-steps."
            )

    @property
    def alpha(self) -> float:
        """The weight of the local parameters in a merge: 0 (replace) without overlap."""
        return self.mix_alpha if self.overlap_steps else 0.0

    def merge_step(self, p: int) -> int:
        return (p + 1) * self.inner_steps // self.fragments

    def send_step(self, p: int) -> int:
        return self.merge_step(p) - self.overlap_steps

    def segments(self) -> list[Segment]:
        """One round as segments; their steps add up to H and each fragment is sent and merged
        once. At one step a send closes a segment and a merge opens the next."""
        events = sorted(
            [(self.send_step(p), 0, p) for p in range(self.fragments)]
            + [(self.merge_step(p), 1, p) for p in range(self.fragments)]
        )
        out, cur, pos = [], Segment(), 0
        for step, kind, p in events:
            if kind == 0:  # send p: the current segment runs up to here and sends
                cur.steps, cur.send = step - pos, p
                out.append(cur)
                cur, pos = Segment(), step
            else:  # merge p: a new segment starts here
                if step > pos or cur.merge is not None:
                    cur.steps = step - pos
                    out.append(cur)
                    cur, pos = Segment(), step
                cur.merge = p
        out.append(cur)  # the last merge, at H
        return out
