"""The collective runtime's costs, measured in real processes under torchrun (gloo, CPU):

(a) `throughput_ratio`: tokens/s of collective DiLoCo with 2 ranks (one thread each, H=50) ÷
    tokens/s of 2 independent plain PyTorch AdamW loops on the same model, run side by side in
    the same 2 processes, interleaved (target ≥ 0.95);
(b) `allreduce_ratio`: effective bandwidth of the outer sync (the outer gradients flattened into
    buckets, all-reduced, unflattened) ÷ that of one raw `dist.all_reduce` of the same number of
    bytes (target ≥ 0.9); the outer step after it is timed apart (`outer_step_ms`).

Prints one JSON object and saves it under benchmarks/results/.

    python benchmarks/collective.py          # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

H = 50
sys.path.insert(0, str(Path(__file__).parent))
from plain import plain_chunk  # noqa: E402


def _rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from diloco.config import TrainConfig
    from diloco.data.recipe import prepare_data, sampler
    from diloco.model.gpt import GPT
    from diloco.run.assemble import adamw, build_trainer, lr_schedule
    from diloco.runtime import torchrun

    torch.set_num_threads(1)
    cfg = TrainConfig(num_workers=2, runtime="collective", inner_steps=H, rounds=args.rounds, out=args.out)
    torchrun.init(cfg)
    data = prepare_data(cfg)
    trainer = build_trainer(cfg, data)
    rank = dist.get_rank()

    # The baseline: a plain loop on this rank (same model, batches and per-step work).
    torch.manual_seed(0)
    model = GPT(cfg.model)
    run_plain = plain_chunk(
        model,
        adamw(model.parameters(), cfg.inner),
        sampler(cfg, data.shards, rank),
        lr_schedule(cfg),
        steps=H,
        grad_clip=cfg.inner.grad_clip,
    )

    times = {"plain": 0.0, "diloco": 0.0}
    run_plain(), trainer.round()  # warm-up
    for r in range(args.rounds):
        order = [("plain", run_plain), ("diloco", trainer.round)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()
            times[name] += time.perf_counter() - t

    # (b) the outer sync against a raw all-reduce of the same bytes
    grads = [torch.randn_like(p) for p in trainer.params]
    nbytes = sum(g.numel() * 4 for g in grads)
    flat = torch.randn(nbytes // 4)
    sync_s = raw_s = step_s = 0.0
    for r in range(args.sync_repeats * 2):
        dist.barrier()
        t = time.perf_counter()
        if r % 2 == 0:  # the outer sync: flatten into buckets, all-reduce, unflatten
            averaged = trainer._allreduce_buckets(grads)
            sync_s += time.perf_counter() - t
            t = time.perf_counter()
            trainer.side.update.step([p.detach().clone() for p in trainer.params], averaged)
            step_s += time.perf_counter() - t
        else:
            dist.all_reduce(flat)
            raw_s += time.perf_counter() - t
    tokens = args.rounds * H * cfg.data.batch_size * cfg.model.seq_len * 2  # both ranks
    if rank == 0:
        result = {
            "benchmark": "collective",
            "ranks": 2,
            "threads_per_rank": 1,
            "model": cfg.model.name,
            "inner_steps": H,
            "timed_rounds": args.rounds,
            "plain_tokens_per_s": round(tokens / times["plain"], 1),
            "diloco_tokens_per_s": round(tokens / times["diloco"], 1),
            "throughput_ratio": round(times["plain"] / times["diloco"], 4),
            "outer_sync_bytes": nbytes,
            "outer_sync_mb_per_s": round(nbytes * args.sync_repeats / sync_s / 1e6, 1),
            "raw_allreduce_mb_per_s": round(nbytes * args.sync_repeats / raw_s / 1e6, 1),
            "allreduce_ratio": round(raw_s / sync_s, 4),
            "outer_step_ms": round(1000 * step_s / args.sync_repeats, 3),
            "targets": {"throughput_ratio": 0.95, "allreduce_ratio": 0.9},
        }
        print(json.dumps(result, indent=2))
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps(result, indent=2) + "\n")
    trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds of H=50 steps per side")
    parser.add_argument("--sync-repeats", type=int, default=20)
    parser.add_argument("--result", default=str(Path(__file__).parent / "results" / "collective.json"))
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank_main(args)
        sys.stdout.flush()
        os._exit(0)  # see diloco.cli.main: skip gloo's teardown race
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--rank",
            "--rounds",
            str(args.rounds),
            "--sync-repeats",
            str(args.sync_repeats),
            "--result",
            args.result,
            "--out",
            tmp,
        ]
        sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
