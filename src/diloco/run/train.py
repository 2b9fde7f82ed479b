"""`diloco train`: set a run up from a TrainConfig (its data, model and run directory; the runtime
from run/assemble.py), drive it through the training loop (loop.py), and write the final model
and the summary.

Every check a user can fail runs before the run directory is created, so bad input leaves
nothing behind.

    diloco train                        # sync DiLoCo, 4 workers, nano GPT, bundled corpus
    diloco train --method async --async-rule dn --dylu --heterogeneity very
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from diloco import rundir
from diloco.config import TrainConfig
from diloco.data.recipe import prepare_data, use_plan
from diloco.data.shard_plan import SHARDS_FILE, ShardPlan
from diloco.data.text import DATA_FILE, TOKENIZER_FILE
from diloco.errors import Interrupted, RunFailed, UserError, brief, resume_step
from diloco.model.init import check_model_config, fit_model, load_init
from diloco.run.assemble import build_trainer, small_shards
from diloco.run.loop import Run, run_async, run_sync, save_checkpoint
from diloco.run.threads import set_threads
from diloco.rundir import checkpoint
from diloco.rundir.metrics import MetricsWriter, NullWriter, check_metrics_offset
from diloco.rundir.summary import summarize
from diloco.runtime import is_main_process


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
    check_model_config(cfg)  # a model transformers cannot build is refused before the data is read
    main = is_main_process(cfg)
    restarted = collective and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    # which torchrun launch this rank belongs to: a restart of it may take its run directory again
    launch = coll.launch_id() if collective and "TORCHELASTIC_RESTART_COUNT" in os.environ else None
    data = prepare_data(cfg, run_dir=resume, progress=progress if main else False)
    cfg = fit_model(cfg, data.tokenizer)
    init = (
        load_init(cfg, data.tokenizer) if resume is None else None
    )  # a resumed run's θ is in its checkpoint
    found: dict[str, Any] = {}

    def decide() -> tuple[str, bool, str]:  # rank 0's: the checkpoint stays in `found`
        run_dir, found["state"] = rundir.open_run(cfg, resume, restarted=restarted, launch=launch)
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
            f"the checkpoint in {run_dir} does not match its config.json ({brief(e)}); "
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
            check_metrics_offset(run_dir, state["metrics_offset"])
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
    loop = run_async if cfg.method == "async" else run_sync
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
