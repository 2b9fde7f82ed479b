"""A job the parameter server handed out and has not had pushed or abandoned yet, and its
checkpoint form (coordinator.py, snapshot.py).

    python -m pytest tests/unit/test_coordinator.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diloco.core.async_policy import DEADLINE_CAP


@dataclass
class Job:
    """A job handed out and not pushed or abandoned yet."""

    job: int
    worker: int
    steps: int
    shard: int
    lr_step: int  # the lr schedule step of its first step: sync, the round's; async, the shard's
    position: int  # where in the shard its batches start: the shard's step count at dispatch
    version: int  # the global parameters' version it starts from
    t: float  # when it was handed out (server time, seconds since the epoch)
    pulled: list[torch.Tensor] | None  # those parameters (what the worker downloads; a lossy
    # download codec's payload, Coordinator.theta_of; async: let go once they went out whole,
    # unless the rule needs them: ServerState.downloaded)
    lr_stride: float = 1.0  # step j uses the lr of lr_step + ⌊j · lr_stride⌋ (sync DiLoCo with DyLU)
    seconds: float | None = None  # a deadline job (--dylu-by time): `steps` are those it reserves
    cap: int | None = None  # a deadline job's most steps (None: DEADLINE_CAP × steps; see `most`)
    round: int | None = None  # Streaming DiLoCo: the round whose fragments it pushes
    keep: bool = False  # Streaming DiLoCo: handed out without θ (the worker goes on from its own)


def job_state(job: Job) -> dict[str, Any]:
    keys = ("job", "worker", "steps", "shard", "lr_step", "position", "version", "t", "lr_stride", "seconds")
    keys += ("cap", "round", "keep")
    return {k: getattr(job, k) for k in keys}


def most_steps(job: Job) -> int:
    """The most inner steps `job` may take: a deadline job's cap, else its steps."""
    if job.seconds is None:
        return job.steps
    return job.cap if job.cap is not None else DEADLINE_CAP * job.steps
