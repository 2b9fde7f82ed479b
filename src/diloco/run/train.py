"""`diloco train`: build the run from a TrainConfig (build.py), drive its runtime (the simulator,
or one rank under torchrun) through the runtime interface, evaluate, log metrics, checkpoint, and
write the summary.

Every check a user can fail runs before the run directory is created, so bad input leaves
nothing behind.

    diloco train                        # sync DiLoCo, 4 workers, nano GPT, bundled corpus
    diloco train --method async --async-rule dn --dylu --heterogeneity very
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from diloco import rundir
from diloco.config import TrainConfig
from diloco.core.membership import active_workers, parse_workers_schedule
from diloco.data.shard_plan import SHARDS_FILE, ShardPlan
from diloco.data.text import DATA_FILE, TOKENIZER_FILE
from diloco.errors import Interrupted, RunFailed, UserError, resume_step
from diloco.run.assemble import (
    Data,
    build_trainer,
    fit_model,
    load_init,
    prepare_data,
    small_shards,
    use_plan,
)
from diloco.rundir import checkpoint
from diloco.rundir.metrics import MetricsWriter, NullWriter, perplexity
from diloco.rundir.summary import summarize
from diloco.runtime import is_main_process

EVAL_BATCH = 64


def set_threads(threads: int) -> None:
    """Intra-op threads as configured; one inter-op thread (small models gain nothing more). More
    threads than this process's cores only slow it down: a warning says so."""
    cores = len(os.sched_getaffinity(0))
    if threads > cores:
        print(
            f"diloco: warning: --threads {threads} is more than the {cores} cores this process may use, "
            f"which makes it slower; use --threads {cores} or fewer.",
            file=sys.stderr,
            flush=True,
        )
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # may be set only once per process, before any parallel work
        pass


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows_NT: torch.Tensor) -> float:
    """Mean next-token cross-entropy over all windows (batched in a fixed order)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows_NT), EVAL_BATCH):
        chunk = windows_NT[start : start + EVAL_BATCH]
        total += model(chunk[:, :-1], chunk[:, 1:]).item() * chunk[:, 1:].numel()
        count += chunk[:, 1:].numel()
    model.train(was_training)
    return total / count


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


def _run_sync(run: Run, *, start_round: int, stop_after: int | None, run_dir: Path, progress) -> bool:
    """Rounds of sync DiLoCo (or a baseline); returns False if stopped early by --stop-after."""
    cfg, trainer, writer = run.cfg, run.trainer, run.writer
    H = cfg.inner_steps
    every = cfg.eval_every or H
    # a worker of M ranks (collective runtime) processes M batches a step
    ranks_per_worker = cfg.procs_per_worker if cfg.runtime == "collective" else 1
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len * ranks_per_worker
    schedule = parse_workers_schedule(cfg.workers_schedule, cfg.num_workers) if cfg.workers_schedule else None
    bar = _progress(cfg, cfg.rounds, start_round, "round", progress)
    try:
        for r in range(start_round + 1, cfg.rounds + 1):
            active = active_workers(schedule, r - 1, cfg.rounds) if schedule else trainer.num_workers
            steps_before = trainer.side.total_steps
            stats = trainer.round(active=active)
            run.tokens += (trainer.side.total_steps - steps_before) * tokens_per_step  # what arrived
            now = run.clock(stats.inner_step)
            for w, loss in zip(stats.workers or range(len(stats.losses)), stats.losses, strict=True):
                writer.log(
                    "inner",
                    **now,
                    worker=w,
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
            if (r * H) // every > ((r - 1) * H) // every or r == cfg.rounds:
                run.evaluate(stats.inner_step)
            bar.update(1)
            bar.set_postfix(
                train_loss=f"{sum(stats.losses) / len(stats.losses):.3f}" if stats.losses else "-",
                val_loss=f"{run.val_loss:.3f}" if run.val_loss is not None else "-",
            )
            stopping = stop_after is not None and r == stop_after and r < cfg.rounds
            if (cfg.checkpoint_every and r % cfg.checkpoint_every == 0) or stopping:
                save_checkpoint(run, r, stats.inner_step, run_dir)
            if stopping:
                return False
    finally:
        bar.close()
    return True


def _run_async(run: Run, *, start_round: int, stop_after: int | None, run_dir: Path, progress) -> bool:
    """The asynchronous server until the compute budget (k × rounds × H inner steps) is spent.
    A "round" here is k × H inner steps applied (one sync round's compute): checkpoints and
    --stop-after count those, and are taken once the grace group that crossed one is applied.
    Returns False if stopped early by --stop-after."""
    cfg, trainer, writer = run.cfg, run.trainer, run.writer
    k, H = trainer.num_workers, cfg.inner_steps
    per_round = k * H
    every = (cfg.eval_every or H) * k  # in inner steps summed over workers
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
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


def train(
    cfg: TrainConfig,
    *,
    resume: Path | None = None,
    stop_after: int | None = None,
    progress: bool | None = None,
    serve=None,
) -> dict[str, Any]:
    """Run (or continue) a training run; returns the summary (or where it stopped early).

    Under torchrun (`runtime = "collective"`) every rank calls this; rank 0 reads and writes the
    run directory and tells the others what it decided (or the user error it found), returns
    the summary, the others return {"rank": r}. The parameter server (`runtime = "server"`,
    `diloco serve`) faces the network as `serve` (a ServeOptions: address, token, TLS,
    status page) says. A job that torchrun restarts after a failure
    resumes from its own run's latest checkpoint, and only its own."""
    threads = cfg.resolved_threads
    collective = cfg.runtime == "collective"
    if collective:
        from diloco.runtime import torchrun as coll

        coll.init(cfg)
        threads = coll.threads_per_rank(cfg)
    set_threads(threads)
    main = is_main_process(cfg)
    restarted = collective and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    data = prepare_data(cfg, run_dir=resume, progress=progress if main else False)
    cfg = fit_model(cfg, data.tokenizer)
    init = (
        load_init(cfg, data.tokenizer) if resume is None else None
    )  # a resumed run's θ is in its checkpoint
    found: dict[str, Any] = {}

    def decide() -> tuple[str, bool, str]:  # rank 0's: the checkpoint stays in `found`
        run_dir, found["state"] = rundir.open_run(cfg, resume, restarted=restarted)
        return str(run_dir), found["state"] is not None, data.plan.to_json()

    if collective:
        run_dir_text, resuming, plan = coll.agree(decide, main=main)
    else:
        run_dir_text, resuming, plan = decide()
    run_dir = Path(run_dir_text)
    data = use_plan(cfg, data, ShardPlan.from_json(plan, "rank 0"))  # every rank trains on rank 0's shards
    if main and not (run_dir / TOKENIZER_FILE).exists():  # eval, generate, export and --resume read it
        data.tokenizer.save(run_dir)
    if main and not (run_dir / DATA_FILE).exists():  # --resume and eval check the text against it
        checkpoint.atomic_write_json(run_dir / DATA_FILE, data.record)
    if main and not (run_dir / SHARDS_FILE).exists():  # --resume, replay and server workers use it
        checkpoint.atomic_write_text(run_dir / SHARDS_FILE, plan)
    if main and (warning := small_shards(cfg, data)):  # the run is set up: it will start
        print(f"diloco: warning: {warning}", file=sys.stderr, flush=True)
    trainer, clean = None, False
    try:
        trainer = build_trainer(cfg, data, init, run_dir=run_dir, serve=serve)
        del init  # the model holds its own copy
        result = _train(
            cfg,
            trainer,
            data,
            state=found.get("state") if resuming else None,
            resuming=resuming,
            stop_after=stop_after,
            progress=progress,
            run_dir=run_dir,
        )
        clean = True
        return result
    except RunFailed as e:  # its step names this run, or drops --resume where there is no checkpoint
        if not main:
            raise
        raise type(e)(resume_step(str(e), rundir.resume_command(cfg, run_dir), run_dir)) from None
    finally:
        if trainer is not None:
            trainer.close(clean=clean)


def _restore(trainer, state: dict[str, Any] | None, run_dir: Path) -> None:
    try:
        trainer.load_state_dict(state["trainer"] if state is not None else None)
        if state is not None:
            torch.set_rng_state(state["torch_rng"])
    except (RunFailed, UserError):  # a process that died while loading; a sentence of its own
        raise
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise UserError(
            f"the checkpoint in {run_dir} does not match its config.json ({str(e)[:160]}); "
            "restore the run's original config.json."
        ) from None


def _train(cfg, trainer, data, *, state, resuming, stop_after, progress, run_dir) -> dict[str, Any]:
    main = trainer.is_main
    if resuming:
        _restore(trainer, state, run_dir)
        # under torchrun only rank 0 read the checkpoint
        state = trainer.broadcast(
            None if state is None else {k: v for k, v in state.items() if k != "trainer"}
        )
        start_round = state["round"]
        if stop_after is not None and stop_after <= start_round:
            left = (
                f"give a round from {start_round + 1} to {cfg.rounds - 1}, or drop it"
                if start_round + 1 < cfg.rounds
                else "no round before the last is left to stop after: drop --stop-after"
            )
            raise UserError(
                f"--stop-after {stop_after} is not after round {start_round}, where {run_dir} resumes; "
                f"{left}."
            )
        if main:
            cfg = rundir.write_config(cfg, run_dir)
        writer = (
            MetricsWriter(run_dir, truncate_to=state["metrics_offset"], purge_step=state["step"] + 1)
            if main
            else NullWriter()
        )
        run = Run(
            cfg,
            trainer,
            data,
            writer,
            tokens=state["tokens"],
            wall_before=state["wall_time_s"],
            target=state.get("target"),
        )
    else:
        start_round = 0
        if main:
            cfg = rundir.write_config(cfg, run_dir)
        run = Run(
            cfg,
            trainer,
            data,
            # a torchrun restart before any checkpoint starts the metrics over
            MetricsWriter(run_dir, truncate_to=0 if (run_dir / "metrics.jsonl").exists() else None)
            if main
            else NullWriter(),
        )
        run.evaluate(0)
        if cfg.checkpoint_every:  # from here on the run can always be resumed
            save_checkpoint(run, 0, 0, run_dir)
    if cfg.runtime == "server":
        trainer.attach_run(run)  # refused pushes get metrics lines
    loop = _run_async if cfg.method == "async" else _run_sync
    try:
        finished = loop(
            run, start_round=start_round, stop_after=stop_after, run_dir=run_dir, progress=progress
        )
    except KeyboardInterrupt:
        run.writer.close()
        if not main:  # rank 0 says where the run can go on
            raise Interrupted(f"rank {trainer.rank} interrupted") from None
        command = rundir.resume_command(cfg, run_dir)
        raise Interrupted(
            f"interrupted; continue with: {command}"
            if command
            else f"interrupted before any checkpoint, so {run_dir} cannot be resumed: delete it (or give "
            "another --out) and start again, with --checkpoint-every N to be able to resume"
        ) from None
    except BaseException:
        run.writer.close()
        raise
    if not finished:
        run.writer.close()
    if not main:
        return {"rank": trainer.rank}
    if not finished:
        return {"stopped_after": stop_after, "run_dir": str(run_dir)}
    side = trainer.side
    step = side.total_steps // trainer.num_workers if cfg.method == "async" else side.inner_step
    final_loss = run.evaluate(step, "full")
    run.writer.close()
    checkpoint.atomic_save_safetensors(side.model.state_dict(), run_dir / "model.safetensors")
    summary = summarize(cfg, run, final_loss, step)
    checkpoint.atomic_write_json(run_dir / "summary.json", summary)
    return summary
