"""The training loops: rounds of sync DiLoCo (or a baseline), or the asynchronous server's arrivals
until the compute budget is spent, through the runtime interface (runtime/__init__.py), with the
run's bookkeeping (`Run`: metrics, evaluations, time-to-target) and its checkpoints. `train()`
(train.py) sets a run up and calls one of them.

    diloco train --rounds 4 --checkpoint-every 2        # run_sync
    diloco train --method async --heterogeneity very    # run_async
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from diloco import rundir
from diloco.config import TrainConfig
from diloco.core.membership import active_workers, parse_workers_schedule
from diloco.data.recipe import Data
from diloco.model.evaluate import evaluate
from diloco.rundir import checkpoint
from diloco.rundir.metrics import MetricsWriter, perplexity


class Run:
    """One run's bookkeeping: metrics, evaluations, time-to-target, the summary."""

    def __init__(
        self,
        cfg: TrainConfig,
        trainer,
        data: Data,
        writer: MetricsWriter,
        *,
        tokens: int = 0,
        wall_before: float = 0.0,
        target: dict | None = None,
    ):
        self.cfg, self.trainer, self.data, self.writer = cfg, trainer, data, writer
        self.tokens = tokens
        self.wall_before = wall_before
        self.t0 = time.perf_counter()
        self.target = target  # first eval at or below cfg.target_loss: its sim time and step
        self.val_loss: float | None = None
        self.timing_total = {"compute_s": 0.0, "comm_s": 0.0}  # real runtimes: measured per round
        self.eval_time_s = 0.0  # wall time spent evaluating (this session of the run)

    @property
    def is_main(self) -> bool:
        """Only the main process (rank 0 under torchrun) evaluates and writes the run directory."""
        return self.trainer.is_main

    def clock(self, inner_step: int) -> dict[str, Any]:
        line = {
            "version": self.trainer.side.version,
            "inner_step": inner_step,
            "tokens": self.tokens,
            "wall_time_s": round(self.wall_time_s(), 3),
        }
        if self.trainer.sim_time_s is not None:  # the simulator's clock; real runtimes have none
            line["sim_time_s"] = round(self.trainer.sim_time_s, 6)
        return line

    def wall_time_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.t0

    def evaluate(self, inner_step: int, split: str = "subset") -> float:
        if not self.is_main:
            return math.nan
        windows = self.data.eval_subset if split == "subset" else self.data.eval_full
        t0 = time.perf_counter()
        loss = evaluate(self.trainer.side.model, windows)
        self.eval_time_s += time.perf_counter() - t0
        now = self.clock(inner_step)
        self.writer.log(
            "eval",
            **now,
            split=split,
            val_loss=loss,
            val_ppl=perplexity(loss),
            bytes_sent=sum(self.trainer.side.bytes_sent),
        )
        if split == "subset":
            self.val_loss = loss
            if self.cfg.target_loss and self.target is None and loss <= self.cfg.target_loss:
                self.target = {
                    "sim_time_s": now.get("sim_time_s"),
                    "inner_step": inner_step,
                    "wall_time_s": now["wall_time_s"],
                }
        return loss


def _progress(cfg: TrainConfig, total: int, initial: int, unit: str, progress: bool | None):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=f"{cfg.method} k={cfg.num_workers} H={cfg.inner_steps}",
        unit=unit,
        disable=None if progress is None else not progress,
    )


def save_checkpoint(run: Run, round_: int, step: int, run_dir: Path) -> None:
    """Checkpoint `round_`, taken at per-worker inner step `step` (a collective call under
    torchrun: every rank joins)."""
    state = run.trainer.state_dict()
    if run.is_main:
        checkpoint.save(
            run_dir / "checkpoints",
            round_,
            {
                "format": rundir.CHECKPOINT_FORMAT,
                "step": step,
                "trainer": state,
                "torch_rng": torch.get_rng_state(),
                "round": round_,
                "tokens": run.tokens,
                "wall_time_s": run.wall_time_s(),
                "target": run.target,
                "metrics_offset": run.writer.offset(),
            },
            keep=run.cfg.keep_checkpoints,
        )
    run.trainer.after_checkpoint()


def run_sync(run: Run, *, start_round: int, stop_after: int | None, run_dir: Path, progress) -> bool:
    """Rounds of sync DiLoCo (or a baseline); returns False if stopped early by --stop-after.
    With DyLU (the trainer's `planner`, core/dylu.py) rounds go on until the budget of k ×
    rounds × H inner steps is spent; the progress bar then counts plain rounds' worth of steps."""
    cfg, trainer, writer = run.cfg, run.trainer, run.writer
    planner = getattr(trainer, "planner", None)
    H = cfg.inner_steps
    every = cfg.eval_every or H
    # a worker of M ranks (collective runtime) processes M batches a step
    ranks_per_worker = cfg.procs_per_worker  # 1 but for collective and server runs
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len * ranks_per_worker
    schedule = parse_workers_schedule(cfg.workers_schedule, cfg.num_workers) if cfg.workers_schedule else None
    bar = _progress(cfg, cfg.rounds, start_round, "round", progress)
    if planner is not None:
        bar.n = round(planner.rounds_estimate, 2)
    r = start_round
    try:
        while (r < cfg.rounds) if planner is None else not planner.done:
            r += 1
            active = active_workers(schedule, r - 1, cfg.rounds) if schedule else trainer.num_workers
            steps_before = trainer.side.total_steps
            stats = trainer.round(active=active)
            run.tokens += (trainer.side.total_steps - steps_before) * tokens_per_step  # what arrived
            now = run.clock(stats.inner_step)
            for i, (w, loss) in enumerate(
                zip(stats.workers or range(len(stats.losses)), stats.losses, strict=True)
            ):
                writer.log(
                    "inner",
                    **now,
                    worker=w,
                    **({} if stats.steps is None else {"steps": stats.steps[i]}),
                    train_loss=loss,
                    lr=stats.lr,
                    bytes_sent=stats.bytes_sent[w],
                    bytes_received=stats.bytes_received[w],
                )
            timing = stats.timing  # real runtimes: measured compute and communication
            if timing:
                total_s = timing["compute_s"] + timing["comm_s"]
                timing = {**timing, "compute_utilisation": timing["compute_s"] / total_s if total_s else 1.0}
                run.timing_total["compute_s"] += timing["compute_s"]
                run.timing_total["comm_s"] += timing["comm_s"]
            writer.log(
                "outer",
                **now,
                bytes_sent=sum(stats.bytes_sent),
                bytes_received=sum(stats.bytes_received),
                **(timing or {}),
            )
            last = r == cfg.rounds if planner is None else planner.done
            if (r * H) // every > ((r - 1) * H) // every or last:
                run.evaluate(stats.inner_step)
            bar.update(1 if planner is None else round(planner.rounds_estimate - bar.n, 2))
            bar.set_postfix(
                train_loss=f"{sum(stats.losses) / len(stats.losses):.3f}" if stats.losses else "-",
                val_loss=f"{run.val_loss:.3f}" if run.val_loss is not None else "-",
            )
            stopping = stop_after is not None and r == stop_after and not last
            if (cfg.checkpoint_every and r % cfg.checkpoint_every == 0) or stopping:
                save_checkpoint(run, r, stats.inner_step, run_dir)
            if stopping:
                return False
    finally:
        bar.close()
    return True


def run_async(run: Run, *, start_round: int, stop_after: int | None, run_dir: Path, progress) -> bool:
    """The asynchronous server until the compute budget (k × rounds × H inner steps) is spent.
    A "round" here is k × H inner steps applied (one sync round's compute): checkpoints and
    --stop-after count those, and are taken once the grace group that crossed one is applied.
    Returns False if stopped early by --stop-after."""
    cfg, trainer, writer = run.cfg, run.trainer, run.writer
    k, H = trainer.num_workers, cfg.inner_steps
    per_round = k * H
    every = (cfg.eval_every or H) * k  # in inner steps summed over workers
    # a server worker of M ranks, or one process in its place, computes M batches a step
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len * cfg.procs_per_worker
    bar = _progress(cfg, trainer.step_budget, trainer.applied, "step", progress)
    last_round = start_round  # the last round boundary handled
    try:
        while not trainer.done:
            a = trainer.step()
            if a is None:
                break
            before = trainer.applied - a.steps
            run.tokens += a.steps * tokens_per_step
            step = trainer.applied // k  # per-worker equivalent, comparable with sync's inner_step
            now = run.clock(step)
            writer.log(
                "worker",
                **now,
                worker=a.worker,
                steps=a.steps,
                staleness=a.staleness,
                shard=a.shard,
                speed_est_s=a.speed_est_s,
                train_loss=a.train_loss,
                lr=a.lr,
                bytes_sent=trainer.side.bytes_sent[a.worker],
                bytes_received=trainer.side.bytes_received[a.worker],
            )
            if a.changed:
                writer.log(
                    "outer",
                    **now,
                    staleness=a.staleness,
                    bytes_sent=sum(trainer.side.bytes_sent),
                    bytes_received=sum(trainer.side.bytes_received),
                )
            if trainer.applied // every > before // every or trainer.applied == trainer.step_budget:
                run.evaluate(step)
            bar.update(a.steps)
            bar.set_postfix(version=trainer.version, val_loss=f"{run.val_loss:.3f}" if run.val_loss else "-")
            r = trainer.applied // per_round
            if r == last_round or not trainer.at_boundary or trainer.done:
                continue
            crossed = range(last_round + 1, r + 1)
            last_round = r
            stopping = stop_after is not None and r >= stop_after
            if (cfg.checkpoint_every and any(x % cfg.checkpoint_every == 0 for x in crossed)) or stopping:
                save_checkpoint(run, r, step, run_dir)
            if stopping:
                return False
    finally:
        bar.close()
    return True
