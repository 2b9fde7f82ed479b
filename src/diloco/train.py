"""`diloco train` in the simulator: build data, model and runtime from a TrainConfig, run the
rounds, evaluate, log metrics, checkpoint, and write the summary.

Every check a user can fail runs before the run directory is created, so bad input leaves
nothing behind.

    diloco train                        # sync DiLoCo, 4 workers, nano GPT, bundled corpus
    diloco train --method dp            # the data-parallel baseline on the same data
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from diloco import checkpoint
from diloco.codec import build_codec, tensor_bytes
from diloco.config import TrainConfig, from_dict, load_json
from diloco.data import ShardSampler, eval_windows, load_corpus, make_shards, validation_tokens
from diloco.errors import UserError
from diloco.metrics import MetricsWriter
from diloco.model import GPT
from diloco.outer import build_outer_opt
from diloco.runtime.sim import DataParallel, DiLoCo
from diloco.schedule import warmup_cosine

EVAL_BATCH = 64
SIM_STEP_S = 1.0  # until speed profiles exist, every inner step costs one simulated second


def set_threads(threads: int) -> None:
    """Intra-op threads as configured; one inter-op thread (small models gain nothing more)."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # may be set only once per process, before any parallel work
        pass


@dataclass
class Data:
    samplers: list[ShardSampler]
    weights: list[float]
    eval_subset: torch.Tensor  # (N, T+1) fixed windows for periodic evals
    eval_full: torch.Tensor  # (M, T+1) the whole validation split


def prepare_data(cfg: TrainConfig) -> Data:
    works = load_corpus()
    k = 1 if cfg.method == "single" else cfg.num_workers
    shards, weights = make_shards(
        works, k, kind=cfg.data.shards, val_fraction=cfg.data.val_fraction, seed=cfg.seed
    )
    samplers = [
        ShardSampler(
            s, batch_size=cfg.data.batch_size, seq_len=cfg.model.seq_len, seed=cfg.seed * 1_000_003 + i
        )
        for i, s in enumerate(shards)
    ]
    val = validation_tokens(works, cfg.data.val_fraction)
    return Data(
        samplers,
        weights,
        eval_windows(val, cfg.model.seq_len, cfg.data.eval_windows),
        eval_windows(val, cfg.model.seq_len),
    )


def build_trainer(cfg: TrainConfig, data: Data) -> DiLoCo:
    """The runtime object for `cfg.method`; the global model is initialised from `cfg.seed`."""
    i = cfg.inner

    def inner_opt(params):
        return torch.optim.AdamW(params, lr=i.lr, betas=(i.beta1, i.beta2), weight_decay=i.weight_decay)

    common = dict(
        inner_steps=cfg.inner_steps,
        lr_schedule=partial(
            warmup_cosine,
            lr=i.lr,
            warmup_steps=i.warmup_steps,
            total_steps=cfg.total_inner_steps,
            min_lr_ratio=i.min_lr_ratio,
        ),
        grad_clip=i.grad_clip,
    )
    torch.manual_seed(cfg.seed)
    model_fn = partial(GPT, cfg.model)
    if cfg.method == "diloco":
        return DiLoCo(
            model_fn,
            inner_opt,
            data.samplers,
            outer_opt=build_outer_opt(cfg.outer),
            weights=data.weights,
            codec=build_codec(cfg.codec),
            **common,
        )
    return DataParallel(model_fn, inner_opt, data.samplers, **common)


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


def _new_run_dir(cfg: TrainConfig) -> Path:
    run_dir = cfg.run_dir
    if cfg.out:
        if run_dir.exists() and any(run_dir.iterdir()):
            raise UserError(
                f"run directory {run_dir} already exists; choose another --out, delete it, "
                f"or continue it with --resume {run_dir}."
            )
    else:  # default names never clobber an earlier run: add -2, -3, ...
        n = 2
        while run_dir.exists():
            run_dir = cfg.run_dir.with_name(f"{cfg.run_dir.name}-{n}")
            n += 1
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def load_run_config(run_dir: Path) -> TrainConfig:
    if not run_dir.is_dir():
        raise UserError(
            f"run directory {run_dir} does not exist; pass the folder of an earlier run to --resume."
        )
    return from_dict(load_json(run_dir / "config.json"), where=str(run_dir / "config.json"))


def _eval_due(step: int, prev_step: int, every: int) -> bool:
    return step // every > prev_step // every


def train(
    cfg: TrainConfig,
    *,
    resume: Path | None = None,
    stop_after: int | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Run (or continue) a training run; returns the summary (or where it stopped early)."""
    set_threads(cfg.resolved_threads)
    data = prepare_data(cfg)
    trainer = build_trainer(cfg, data)
    state = None
    if resume is not None:
        found = checkpoint.latest(resume / "checkpoints")
        if found is None:
            raise UserError(
                f"run directory {resume} has no checkpoint to resume from; "
                "checkpoints are saved only with --checkpoint-every."
            )
        state = checkpoint.load(found)
        run_dir = resume
    else:
        run_dir = _new_run_dir(cfg)
        cfg = dataclasses.replace(cfg, out=str(run_dir))
        checkpoint.atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))

    k, H = trainer.num_workers, cfg.inner_steps
    tokens_per_round = k * H * cfg.data.batch_size * cfg.model.seq_len
    start_round, tokens, wall_before = 0, 0, 0.0
    if state is not None:
        trainer.load_state_dict(state["trainer"])
        torch.set_rng_state(state["torch_rng"])
        start_round, tokens, wall_before = state["round"], state["tokens"], state["wall_time_s"]
        writer = MetricsWriter(run_dir, truncate_to=state["metrics_offset"], purge_step=start_round * H + 1)
    else:
        writer = MetricsWriter(run_dir)
    t0 = time.perf_counter()

    def clock() -> dict[str, Any]:
        step = trainer.workers[0].step
        return {
            "version": trainer.version,
            "inner_step": step,
            "tokens": tokens,
            "wall_time_s": round(wall_before + time.perf_counter() - t0, 3),
            "sim_time_s": step * SIM_STEP_S,
        }

    def log_eval(windows: torch.Tensor, split: str) -> float:
        loss = evaluate(trainer.model, windows)
        writer.log("eval", **clock(), split=split, val_loss=loss, val_ppl=math.exp(loss))
        return loss

    from tqdm import tqdm

    bar = tqdm(
        total=cfg.rounds,
        initial=start_round,
        desc=f"{cfg.method} k={k} H={H}",
        unit="round",
        disable=None if progress is None else not progress,
    )
    val_loss = None
    if start_round == 0:
        val_loss = log_eval(data.eval_subset, "subset")
    try:
        for r in range(start_round + 1, cfg.rounds + 1):
            stats = trainer.round()
            tokens += tokens_per_round
            for w, loss in enumerate(stats.losses):
                writer.log(
                    "inner",
                    **clock(),
                    worker=w,
                    train_loss=loss,
                    lr=stats.lr,
                    bytes_sent=stats.bytes_sent[w],
                    bytes_received=stats.bytes_received[w],
                )
            writer.log(
                "outer", **clock(), bytes_sent=sum(stats.bytes_sent), bytes_received=sum(stats.bytes_received)
            )
            if _eval_due(r * H, (r - 1) * H, cfg.eval_every):
                val_loss = log_eval(data.eval_subset, "subset")
            bar.update(1)
            bar.set_postfix(
                train_loss=f"{sum(stats.losses) / len(stats.losses):.3f}",
                val_loss=f"{val_loss:.3f}" if val_loss is not None else "-",
            )
            stopping = stop_after is not None and r == stop_after and r < cfg.rounds
            if (cfg.checkpoint_every and r % cfg.checkpoint_every == 0) or stopping:
                checkpoint.save(
                    run_dir / "checkpoints",
                    r,
                    {
                        "trainer": trainer.state_dict(),
                        "torch_rng": torch.get_rng_state(),
                        "round": r,
                        "tokens": tokens,
                        "wall_time_s": clock()["wall_time_s"],
                        "metrics_offset": writer.offset(),
                    },
                )
            if stopping:
                writer.close()
                return {"stopped_after": r, "run_dir": str(run_dir)}
    finally:
        bar.close()

    final_loss = log_eval(data.eval_full, "full")
    writer.close()
    save_file(
        {k_: v.contiguous() for k_, v in trainer.model.state_dict().items()},
        str(run_dir / "model.safetensors"),
    )
    summary = _summary(cfg, trainer, final_loss, tokens, clock())
    checkpoint.atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _summary(cfg: TrainConfig, trainer: DiLoCo, val_loss: float, tokens: int, now: dict) -> dict[str, Any]:
    k = trainer.num_workers
    steps = trainer.workers[0].step
    per_worker = trainer.bytes_sent[0]
    # Data parallel sends one gradient per worker per inner step.
    dp_per_worker = steps * tensor_bytes(trainer.params) if k > 1 else 0
    return {
        "run_dir": cfg.out,
        "method": cfg.method,
        "num_workers": k,
        "params": sum(p.numel() for p in trainer.params),
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "tokens": tokens,
        "inner_steps": steps * k,  # data parallel: every worker computes a gradient per step
        "inner_steps_per_worker": steps,
        "outer_updates": trainer.version,
        "bytes_sent": sum(trainer.bytes_sent),
        "bytes_received": sum(trainer.bytes_received),
        "bytes_sent_per_worker": per_worker,
        "dp_bytes_sent_per_worker": dp_per_worker,
        "dp_bytes_ratio": dp_per_worker / per_worker if per_worker else None,
        "wall_time_s": now["wall_time_s"],
        "sim_time_s": now["sim_time_s"],
    }


def format_summary(s: dict[str, Any]) -> str:
    mb = 1e6
    lines = [
        f"done in {s['wall_time_s']:.1f} s: {s['run_dir']}",
        f"  val_loss {s['val_loss']:.4f}   val_ppl {s['val_ppl']:.3f}   (whole validation split)",
        f"  tokens {s['tokens']:,}   inner steps {s['inner_steps']:,} "
        f"({s['inner_steps_per_worker']:,} per worker)   outer updates {s['outer_updates']}",
    ]
    if s["method"] == "dp" and s["bytes_sent_per_worker"]:
        lines.append(
            f"  bytes sent per worker {s['bytes_sent_per_worker'] / mb:.2f} MB (a gradient every step)"
        )
    elif s["dp_bytes_ratio"] is not None:
        lines.append(
            f"  bytes sent per worker {s['bytes_sent_per_worker'] / mb:.2f} MB: "
            f"{s['dp_bytes_ratio']:.1f}x fewer than data parallel "
            f"({s['dp_bytes_sent_per_worker'] / mb:.2f} MB) for the same inner steps"
        )
    else:
        lines.append("  bytes sent per worker 0 (one worker: nothing to communicate)")
    return "\n".join(lines)
