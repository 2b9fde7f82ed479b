"""Batches: the samplers that read a worker's batches from its shard (or, in async, from the
shard the server hands it), the adapters that cut a worker's batch for one rank or move it to a
device, and the fixed validation windows."""

from __future__ import annotations

import torch

from diloco.errors import UserError


class ShardSampler:
    """Random windows from one shard: an endless iterator of (inputs_BT, targets_BT).

    Batch number n is drawn from a generator seeded by (seed, n) alone, so the data position is
    just `step` (what checkpoints save), and any process can produce any batch of any shard.
    """

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, seq_len: int, seed: int):
        need = batch_size * seq_len + 1
        if len(tokens) < need:
            raise UserError(
                f"a shard has {len(tokens)} tokens, fewer than one batch needs ({need}); "
                "give more text, or use fewer --workers, a smaller --batch-size or a shorter --seq-len."
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        self.step += 1
        high = len(self.tokens) - self.seq_len
        starts_B = torch.randint(high, (self.batch_size,), generator=generator)
        offsets_BT = starts_B[:, None] + torch.arange(self.seq_len + 1)
        window_BT = self.tokens[offsets_BT].long()
        return window_BT[:, :-1], window_BT[:, 1:]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class ShardSet:
    """Batches from any of several shards: `seek(shard, step)` picks where the next batch comes
    from. The asynchronous server uses it to hand a worker a sampled shard at that shard's own
    position. Without a seek it reads its `current` shard (the worker's own)."""

    def __init__(self, samplers: list[ShardSampler], current: int):
        self.samplers = samplers
        self.current = current

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(self.samplers[self.current])

    def seek(self, shard: int, step: int) -> None:
        self.current = shard
        self.samplers[shard].step = step

    def state_dict(self) -> dict:
        return {"current": self.current, "steps": [s.step for s in self.samplers]}

    def load_state_dict(self, state: dict) -> None:
        self.current = int(state["current"])
        for sampler, step in zip(self.samplers, state["steps"], strict=True):
            sampler.step = int(step)


class RankSlice:
    """A rank's rows of its worker's batch (the collective runtime): the worker batch is M × B
    rows, rank j takes rows [jB, (j+1)B), so M ranks together compute the gradient of the whole
    worker batch."""

    def __init__(self, batches, local: int, per_rank: int):
        self.batches, self.local, self.per_rank = batches, local, per_rank

    def __iter__(self):
        return self

    def __next__(self):
        lo, hi = self.local * self.per_rank, (self.local + 1) * self.per_rank
        return tuple(t[lo:hi] for t in next(self.batches))

    def seek(self, shard: int, step: int) -> None:  # a server's group worker is told where to read
        self.batches.seek(shard, step)

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)


class ToDevice:
    """Batches moved to a device (a rank's GPU, or a server worker's --device): the data is
    sampled on the CPU."""

    def __init__(self, batches, device: torch.device):
        self.batches, self.device = batches, device

    def __iter__(self):
        return self

    def __next__(self):
        return tuple(t.to(self.device, non_blocking=True) for t in next(self.batches))

    def seek(self, shard: int, step: int) -> None:  # a server's worker is told where to read
        self.batches.seek(shard, step)

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)


class Windows:
    """Evaluation windows: (seq_len + 1)-token windows of a token sequence, read when indexed
    (an int or a slice gives tensors), so a large validation split is never all in memory."""

    def __init__(self, tokens, starts: torch.Tensor, seq_len: int):
        self.tokens, self.starts, self.seq_len = tokens, starts, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.starts), self.seq_len + 1)

    def __getitem__(self, i: int | slice) -> torch.Tensor:
        if isinstance(i, int):
            return self[slice(i, i + 1 if i != -1 else None)][0]
        return self.tokens[self.starts[i, None] + torch.arange(self.seq_len + 1)].long()

    def tokens_predicted(self) -> int:
        return len(self) * self.seq_len


def eval_windows(tokens, seq_len: int, limit: int | None = None) -> Windows:
    """Non-overlapping (seq_len + 1)-token windows of the validation stream, evenly spaced when
    `limit` picks a subset, so every method and runtime evaluates on the same windows."""
    n = (len(tokens) - 1) // seq_len
    if n == 0:
        raise UserError("the validation split is shorter than one window; use a shorter --seq-len.")
    idx = torch.arange(n) if limit is None or limit >= n else torch.linspace(0, n - 1, limit).long()
    return Windows(tokens, idx * seq_len, seq_len)
