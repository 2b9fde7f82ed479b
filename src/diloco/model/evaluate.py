"""A model's validation loss: mean next-token cross-entropy over fixed windows, in batches of a
fixed order, so every method and runtime measures alike (the training loop's evals, `diloco eval`).

    python -c "import torch; from diloco.model.evaluate import evaluate; from diloco.model.gpt import GPT; \
from diloco.config import ModelConfig; print(evaluate(GPT(ModelConfig()), torch.randint(0, 256, (4, 65))))"
"""

from __future__ import annotations

import torch

EVAL_BATCH = 64  # windows per batch, fewer where their logits would pass EVAL_LOGITS_BYTES
# logits (and cross-entropy's copy of them) are B x T x vocab floats: 64 windows of the 20m and
# 150m presets (256 tokens, 32k vocab) took 4.2 GB, a server's largest peak (its final evaluation)
EVAL_LOGITS_BYTES = 256 << 20


def eval_batch(model: torch.nn.Module, window: int) -> int:
    """Windows of `window` tokens per evaluation batch: EVAL_BATCH, or as many as keep their
    float32 logits within EVAL_LOGITS_BYTES (at least one)."""
    vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "cfg", None), "vocab_size", 256)
    return max(1, min(EVAL_BATCH, EVAL_LOGITS_BYTES // (4 * window * vocab)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows_NT: torch.Tensor) -> float:
    """Mean next-token cross-entropy over all windows (batched in a fixed order, `eval_batch`)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    batch = eval_batch(model, windows_NT.shape[1] - 1)
    for start in range(0, len(windows_NT), batch):
        chunk = windows_NT[start : start + batch]
        total += model(chunk[:, :-1], chunk[:, 1:]).item() * chunk[:, 1:].numel()
        count += chunk[:, 1:].numel()
    model.train(was_training)
    return total / count
