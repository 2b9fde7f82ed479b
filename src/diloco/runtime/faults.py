"""Fault injection for tests only: kill, hang or poison one worker at a chosen inner step, or
perturb one rank's global parameters.

Set `DILOCO_FAULT` to one of
- `kill:ID:STEP`     SIGKILL the process computing worker ID (under torchrun: every rank of
                     worker ID) when that worker is about to take its inner step STEP (counted
                     from 0 over the run);
- `hang:ID:STEP`     the same process sleeps for an hour instead (a hung rank or process);
- `nan:ID:STEP`      worker ID's training loss at inner step STEP is NaN;
- `perturb:ID:ROUND` after round ROUND (from 1), rank ID's global parameters change by 1e-3.
Under torchrun, `kill` and `hang` fire on the first attempt only, so a restarted job runs
through. Faults are installed by wrapping a worker or an outer side when it is built, so the
round's code has no hooks.
"""

from __future__ import annotations

import os
import signal
import time


def _spec(kind: str, ident: int) -> int | None:
    parts = os.environ.get("DILOCO_FAULT", "").split(":")
    if len(parts) != 3 or parts[0] != kind or int(parts[1]) != ident:
        return None
    if kind in ("kill", "hang") and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    return int(parts[2])


def wrap_worker(worker, ident: int):
    """Install the kill, hang or nan fault for worker (or rank) `ident`, if DILOCO_FAULT names it."""
    for kind in ("kill", "hang", "nan"):
        at = _spec(kind, ident)
        if at is not None:
            break
    else:
        return worker
    train_step, loss_fn = worker.train_step, worker.loss_fn

    def faulty(lr_step=None):
        worker.loss_fn = loss_fn
        if worker.step == at:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                time.sleep(3600)
            else:
                worker.loss_fn = lambda model, batch: loss_fn(model, batch) * float("nan")
        return train_step(lr_step)

    worker.train_step = faulty
    return worker


def wrap_side(side, rank: int):
    """Install the `perturb` fault for `rank` on its outer side (the collective runtime's replica
    check must catch it)."""
    at = _spec("perturb", rank)
    if at is None:
        return side
    end_round = side.end_round

    def perturbed(*args, **kwargs):
        changed = end_round(*args, **kwargs)
        if side.rounds_done == at:
            import torch

            with torch.no_grad():
                side.params[0].view(-1)[0] += 1e-3
        return changed

    side.end_round = perturbed
    return side
