"""Joining a torchrun job: the process group and its store, the launch's id, thread counts, and
decisions rank 0 makes for everyone (`agree`). The collective runtime (collective.py) runs on
top of this.

    torchrun --standalone --nproc-per-node 2 -m diloco train --runtime collective
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco.config import TrainConfig
from diloco.core.inner import Worker
from diloco.data.batches import RankSlice, ToDevice
from diloco.errors import RunFailed, UserError


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local world size) as torchrun sets them."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "--runtime collective runs under torchrun; launch it as "
            "'torchrun --standalone --nproc-per-node 2 -m diloco train --runtime collective ...'."
        )
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def agree(decide: Callable[[], Any], *, main: bool) -> Any:
    """Rank 0 runs `decide` (checks that need the run directory, which other machines may not
    see) and every rank gets its value, or raises the same UserError with rank 0's sentence,
    instead of dying later in a collective with a peer's "Connection closed"."""
    box: list[Any] = [None]
    failure = None
    if main:
        try:
            box[0] = ("ok", decide())
        except UserError as e:
            box[0] = ("error", str(e))
        except Exception as e:  # an internal error: rank 0 shows it, the others a sentence
            box[0], failure = ("failed", f"rank 0 failed while preparing the run ({type(e).__name__})"), e
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if failure is not None:
        raise failure
    if kind == "error":
        raise UserError(value)
    if kind == "failed":
        raise RunFailed(f"{value}; see rank 0's output.")
    return value


def threads_per_rank(cfg: TrainConfig) -> int:
    """--threads, or this machine's cores shared evenly by its ranks (one each on 2 cores)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return cfg.threads or max(1, len(os.sched_getaffinity(0)) // local_world)


def init(cfg: TrainConfig) -> None:
    """Join the job torchrun started: gloo for CPU tensors (the outer sync always uses it), with
    `timeout_s` for every collective and the store, so a hung rank ends the run in that time."""
    _, world, _ = world_from_env()
    if world % cfg.procs_per_worker:
        raise UserError(
            f"torchrun started {world} ranks, which --procs-per-worker {cfg.procs_per_worker} does not "
            "divide; start a multiple of it."
        )
    if cfg.num_workers != world // cfg.procs_per_worker:
        raise UserError(
            f"--workers {cfg.num_workers} does not match {world} ranks with --procs-per-worker "
            f"{cfg.procs_per_worker} ({world // cfg.procs_per_worker} workers); drop --workers or fix it."
        )
    join(timedelta(seconds=cfg.timeout_s))


def join(timeout: timedelta) -> None:
    """Join the process group torchrun started, over gloo (once per process), with `timeout` for
    every collective and the store."""
    if not dist.is_initialized():
        global _LAUNCH_ID
        store = _store(timeout)
        _LAUNCH_ID = _launch_nonce(store)
        attempt = dist.PrefixStore(
            f"diloco/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
        )
        dist.init_process_group(
            "gloo",
            store=attempt,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )


def data_parallel_rank(
    worker: Worker, *, local: int, ranks: int, per_rank: int, device: torch.device, group: Any
) -> None:
    """Make `worker` rank `local` of `ranks` computing one worker's batches together: it takes its
    `per_rank` rows of each batch, lives on `device`, and DistributedDataParallel averages the
    ranks' gradients over `group` at every inner step (the collective runtime's workers of
    --procs-per-worker ranks, and the server's torchrun group workers, run/group.py)."""
    if ranks > 1:
        worker.batches = RankSlice(worker.batches, local, per_rank)
    if device.type != "cpu":
        worker.model.to(device)  # before the optimizer's first step, so its state follows
        worker.batches = ToDevice(worker.batches, device)
    if ranks > 1:
        worker.model = DistributedDataParallel(
            worker.model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group,
        )


_LAUNCH_ID: str | None = None


def launch_id() -> str | None:
    """An id of this torchrun launch: the same in all its restarts, new for every launch."""
    return _LAUNCH_ID


def _launch_nonce(store: dist.Store) -> str:
    """A random id that rank 0 of the first attempt puts in torchrun's agent store, which lives as
    long as the launch and survives its restarts (torchrun's own run id is "none" unless
    --standalone or --rdzv-id gives one, so it cannot tell launches apart). Where the store does
    not survive restarts (no agent store), every attempt gets a new id and a restart never takes
    back a directory: safe, if less convenient."""
    key = "diloco/launch_id"
    if int(os.environ["RANK"]) == 0:
        return store.compare_set(key, "", uuid.uuid4().hex).decode()
    return store.get(key).decode()


def _store(timeout: timedelta) -> dist.Store:
    """torchrun's store. Its keys are prefixed by the restart attempt for the process group:
    torchrun's agent keeps its store across restarts, and without a prefix a restarted rank can
    read the dead attempt's addresses and fail to connect ("Gloo connectFullMesh failed ...
    Connection refused")."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent and int(os.environ["RANK"]) == 0,
        timeout=timeout,
        multi_tenant=not agent,
    )
