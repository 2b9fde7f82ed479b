"""What does DiLoCo's machinery cost? A plain PyTorch AdamW loop against diloco's simulator with
one worker and H=50, same model, data, batch and number of inner steps, interleaved in one
process, with 1 and with 2 intra-op threads. Prints one JSON object and saves it under
benchmarks/results/.

    python benchmarks/overhead.py            # ~2 minutes on 2 cores
    python benchmarks/overhead.py --rounds 1 # a quick look

Both sides run the same per-step work a real loop has (lr schedule, gradient clipping, reading
the loss), so `ratio` isolates what DiLoCo adds: copying the global parameters in, computing
outer_grad, encoding it and the outer Nesterov step, once every H steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

from diloco.config import TrainConfig
from diloco.core.lr import warmup_cosine
from diloco.data.batches import ShardSampler
from diloco.data.recipe import prepare_data
from diloco.model.gpt import GPT
from diloco.runtime.sim import DiLoCo

sys.path.insert(0, str(Path(__file__).parent))
from plain import plain_chunk  # noqa: E402

H = 50


def _setup(cfg: TrainConfig):
    shard = prepare_data(dataclasses.replace(cfg, method="single")).shards[0]
    sampler = partial(ShardSampler, shard, batch_size=cfg.data.batch_size, seq_len=cfg.model.seq_len, seed=1)
    i = cfg.inner
    schedule = partial(
        warmup_cosine, lr=i.lr, warmup_steps=i.warmup_steps, total_steps=10_000, min_lr_ratio=i.min_lr_ratio
    )

    def adamw(params):
        return torch.optim.AdamW(params, lr=i.lr, betas=(i.beta1, i.beta2), weight_decay=i.weight_decay)

    torch.manual_seed(0)
    plain_model = GPT(cfg.model)
    run_plain = plain_chunk(
        plain_model, adamw(plain_model.parameters()), sampler(), schedule, steps=H, grad_clip=i.grad_clip
    )

    torch.manual_seed(0)
    trainer = DiLoCo(
        partial(GPT, cfg.model),
        adamw,
        [sampler()],
        inner_steps=H,
        lr_schedule=schedule,
        grad_clip=i.grad_clip,
    )
    return run_plain, trainer.round


def measure(threads: int, rounds: int, cfg: TrainConfig) -> dict:
    torch.set_num_threads(threads)
    plain_chunk, diloco_round = _setup(cfg)
    plain_chunk(), diloco_round()  # warm-up: allocator, kernels
    times = {"plain": 0.0, "diloco": 0.0}
    for r in range(rounds):
        # alternate which side goes first so drift in machine speed falls on both equally
        order = [("plain", plain_chunk), ("diloco", diloco_round)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            fn()
            times[name] += time.perf_counter() - t
    tokens = rounds * H * cfg.data.batch_size * cfg.model.seq_len
    plain, diloco = tokens / times["plain"], tokens / times["diloco"]
    return {
        "plain_tokens_per_s": round(plain, 1),
        "diloco_tokens_per_s": round(diloco, 1),
        "ratio": round(diloco / plain, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds of H=50 steps per side")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "overhead.json")
    args = parser.parse_args()
    cfg = TrainConfig()
    torch.set_num_interop_threads(1)
    by_threads = {t: measure(t, args.rounds, cfg) for t in (1, 2)}
    best = max(by_threads, key=lambda t: by_threads[t]["diloco_tokens_per_s"])
    result = {
        "benchmark": "overhead",
        "model": cfg.model.name,
        "batch_size": cfg.data.batch_size,
        "seq_len": cfg.model.seq_len,
        "inner_steps": H,
        "timed_steps_per_side": args.rounds * H,
        **by_threads[min(cfg.resolved_threads, 2)],
        "threads": min(cfg.resolved_threads, 2),
        "tokens_per_s_by_threads": {str(t): v for t, v in by_threads.items()},
        "fastest_threads": best,
        "default_threads_is_fastest": best == min(cfg.resolved_threads, 2),
        "target_ratio": 0.98,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads max, torch {torch.__version__}",
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
