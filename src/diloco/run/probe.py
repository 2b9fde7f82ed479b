"""`diloco plan --probe`: a model's seconds per inner step on this machine, timed (the planner's
step time when the user has no figure for it).

    python -c "from diloco.config import TrainConfig; from diloco.run.probe import probe_step_s; \
print(probe_step_s(TrainConfig()))"
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from diloco.config import TrainConfig
from diloco.errors import UserError, brief
from diloco.model.init import build_model
from diloco.run.assemble import adamw
from diloco.run.threads import set_threads
from diloco.runtime.sim import make_worker


def probe_step_s(cfg: TrainConfig, steps: int = 5, warmup: int = 2) -> float:
    """Seconds per inner step of `cfg`'s model on this machine's CPU (the median of `steps` timed
    AdamW steps on random tokens of the run's batch shape, after `warmup` untimed ones)."""
    set_threads(cfg.resolved_threads)
    b, t, vocab = cfg.data.batch_size, cfg.model.seq_len, cfg.model.vocab_size
    g = torch.Generator().manual_seed(cfg.seed)

    def batches():
        while True:
            tokens = torch.randint(0, vocab, (b, t + 1), generator=g)
            yield tokens[:, :-1], tokens[:, 1:]

    try:
        worker = make_worker(partial(build_model, cfg), partial(adamw, inner=cfg.inner), batches())
    except (RuntimeError, MemoryError) as e:
        raise UserError(
            f"--probe cannot build the model on this machine ({brief(e)}); give --step-s."
        ) from None
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        worker.train_step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
