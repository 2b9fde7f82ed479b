"""`diloco replay RUN_DIR`: re-run a parameter server run in one process, on the schedule its
event log recorded, and check the final global parameters bit for bit.

The server wrote every event to RUN_DIR/events.jsonl (coordinator.py lists them): who joined,
which job went to whom with how many steps, which shard and from which version, in which order
outer_grads arrived and were applied. Replay builds the same outer side and, for each worker
that joined, a fresh worker in this process; it computes each job when its push (or a late
push, or a refused push of the worker's own job: the worker ran it all the same) comes up,
from the parameters the job was handed, and applies the same events with those outer_grads
instead of the received ones. A worker's result depends only on its own state and
the parameters it starts from, so if the workers and this process compute alike (CPU, one
intra-op thread: `diloco worker`'s default) the final parameters are equal bit for bit, which
shows that the server applied exactly the algorithm and nothing else. Each replayed job's
training loss is compared with the one the worker reported, to name the first job that differs.

    diloco replay runs/srv
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from diloco.core.inner import Worker
from diloco.data.recipe import prepare_data
from diloco.errors import UserError
from diloco.model.init import load_init, with_tied
from diloco.run.assemble import build_side, build_worker
from diloco.run.replay_fragments import FragmentReplay
from diloco.run.threads import set_threads
from diloco.rundir import load_run_config
from diloco.runtime.server.coordinator import Coordinator


def replay(run_dir: Path, *, progress: bool | None = None) -> dict[str, Any]:
    """Replay `run_dir`; returns what was compared (see the module docstring)."""
    from tqdm import tqdm

    cfg = load_run_config(run_dir)
    if cfg.runtime != "server":
        raise UserError(
            f"{run_dir} is a {cfg.runtime} run; diloco replay re-runs parameter server runs only."
        )
    final_path = run_dir / "model.safetensors"
    if not final_path.is_file() or not (run_dir / "events.jsonl").is_file():
        raise UserError(f"{run_dir} has no model.safetensors or events.jsonl; replay a finished server run.")
    try:
        with open(run_dir / "events.jsonl") as f:  # (line number, event): the log's own numbering
            events = [(n, json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]
    except ValueError:
        raise UserError(
            f"{run_dir / 'events.jsonl'} is damaged (a line is not JSON); it cannot be replayed: restore "
            "it from a copy, or replay another run."
        ) from None

    def damaged(line: int, e: Exception) -> UserError:  # not one server's log, in order
        return UserError(
            f"{run_dir / 'events.jsonl'} is damaged at line {line} ({e}): its events do not follow one "
            "another as one server's do (two servers wrote to it, or it was edited), so it cannot be "
            "replayed: restore it from a copy, or replay another run."
        )

    set_threads(1)
    data = prepare_data(cfg, run_dir=run_dir)
    coord = Coordinator(cfg, build_side(cfg, data, load_init(cfg)), [len(s) for s in data.shards])
    workers: dict[int, Any] = {}  # slot -> its current worker
    handed: dict[int, tuple] = {}  # job -> (worker object, start, the Job, its keyword arguments)
    fragments = FragmentReplay(coord) if coord.schedule is not None else None  # Streaming DiLoCo
    first_loss_mismatch = None
    exact = True  # whether a bitwise equal result is expected (groups of more than 2 ranks: not)
    for line, event in tqdm(
        events, desc="replay", unit="event", disable=None if progress is None else not progress
    ):
        message, ran = None, None
        try:
            kind = event["kind"]
            if kind == "join":
                slot = event["worker"]
            elif fragments is not None:
                message = fragments.on_event(kind, event, workers)
            elif kind == "regive":  # asked for again after its θ went out: never run
                handed.pop(event["job"])
            elif kind in ("push", "late") or (kind == "reject" and event["abandon"]):
                # the worker ran the job whether its push was applied, came late or was refused
                ran = handed.pop(event["job"])
        except (KeyError, TypeError, ValueError) as e:
            raise damaged(line, e) from None
        if kind == "join":
            workers[slot] = build_worker(slot, cfg, data.shards, batch_multiple=cfg.procs_per_worker)
            if (ranks := event.get("ranks", 1)) > 1:
                as_group(workers[slot], ranks)
                exact = exact and ranks <= 2
        elif ran is not None:
            worker, start, handed_job, job = ran  # a deadline job: the steps its push says it took
            result = worker.run(start, coord.ran_steps(handed_job, event.get("steps")), **job)
            message = result.message
            if kind == "push" and first_loss_mismatch is None and result.mean_loss != event["loss"]:
                first_loss_mismatch = {
                    "job": event["job"],
                    "worker": event["worker"],
                    "reported": event["loss"],
                    "replayed": result.mean_loss,
                }
        try:
            coord.apply(event, message)
            if kind == "dispatch" and fragments is not None:
                fragments.dispatched(coord.jobs[event["job"]], workers)
            elif kind == "dispatch":
                job = coord.jobs[event["job"]]
                kwargs = {"lr_step": job.lr_step, "shard": job.shard, "position": job.position}
                handed[job.job] = (
                    workers[job.worker],
                    coord.theta_of(job.pulled),
                    job,
                    {**kwargs, "lr_stride": job.lr_stride},
                )
        except (KeyError, ValueError, TypeError) as e:
            raise damaged(line, e) from None
    if not coord.finished:
        raise UserError(
            f"the event log of {run_dir} stops before the run's end; replay a finished server run."
        )
    final = with_tied(coord.side.model, load_file(str(final_path)))
    mine = coord.side.model.state_dict()
    diff = max((mine[k] - final[k]).abs().max().item() for k in final)
    return {
        "run_dir": str(run_dir),
        "events": len(events),
        "jobs": coord.next_job,
        "outer_updates": coord.side.version,
        "bitwise_equal": all(torch.equal(mine[k], final[k]) for k in final) and mine.keys() == final.keys(),
        "max_abs_diff": diff,
        "first_loss_mismatch": first_loss_mismatch,
        **(
            {}
            if exact
            else {
                "note": "workers of more than 2 ranks sum their gradients in gloo's order, which one "
                "process does not repeat: expect equality up to float rounding, not bit for bit"
            }
        ),
    }


def as_group(worker: Worker, ranks: int) -> None:
    """Make `worker` compute each step's gradient as a torchrun group of `ranks` does
    (run/group.py): each rank's rows' gradient, averaged (DistributedDataParallel divides each by
    the ranks and all-reduces the sum; for 2 ranks (a + b) / 2 is that bit for bit)."""
    model, loss_fn, params = worker.model, worker.loss_fn, worker.params

    def backward(batch):
        rows = len(batch[0]) // ranks
        worker.optimizer.zero_grad(set_to_none=True)
        losses = []
        for r in range(ranks):
            loss = loss_fn(model, tuple(t[r * rows : (r + 1) * rows] for t in batch))
            loss.backward()
            losses.append(loss)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.div_(ranks)
        return losses[0]  # the leader's, which the group reports

    worker.backward = backward
