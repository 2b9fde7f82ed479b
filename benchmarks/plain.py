"""The baseline both throughput benchmarks compare against: a plain PyTorch training loop, written
out as a user would (no diloco code in its step), with the same per-step work a real loop has:
an lr schedule, gradient clipping and reading the loss."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def plain_chunk(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterator,
    schedule: Callable[[int], float],
    *,
    steps: int,
    grad_clip: float,
) -> Callable[[], None]:
    """A function that runs the next `steps` steps of the plain loop each time it is called."""
    done = [0]

    def run() -> None:
        for _ in range(steps):
            for group in opt.param_groups:
                group["lr"] = schedule(done[0])
            loss = model(*next(batches))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            loss.item()
            done[0] += 1

    return run
