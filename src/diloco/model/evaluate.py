"""A model's validation loss: mean next-token cross-entropy over fixed windows, in batches of a
fixed order, so every method and runtime measures alike (the training loop's evals, `diloco eval`).

    python -c "import torch; from diloco.model.evaluate import evaluate; from diloco.model.gpt import GPT; \
from diloco.config import ModelConfig; print(evaluate(GPT(ModelConfig()), torch.randint(0, 256, (4, 65))))"
"""

from __future__ import annotations

import torch

EVAL_BATCH = 64


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
