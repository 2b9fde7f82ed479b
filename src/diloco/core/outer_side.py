"""The outer side: everything DiLoCo keeps between workers, as one pure-PyTorch object.

`OuterSide` holds the global parameters, the outer optimizer (sync) or async rule, `version`,
the round count, which workers start from their own parameters (their last outer_grad was
dropped), the byte counters, and decodes outer_grad messages through the codec. It knows
nothing of processes, sockets or clocks: the simulator, every rank of the collective runtime
(each applies the same summed update) and the parameter server keep one each.
Runtimes move encoded messages to it and parameters from it, and `state_dict` is the one layout
every runtime checkpoints, so a run can stop in one runtime and resume in another.

A synchronous round, as every runtime drives it:

    starts = side.begin_round(active)          # who pulls θ (bytes counted here)
    ... each active worker w runs H inner steps from θ (or its own parameters) ...
    side.report(w, nbytes, finite)             # for every active worker, in worker order
    summed = Σ_w side.contribution(w, message) # in worker order, or by an all-reduce
    side.end_round(summed, inner_steps=H)      # the outer step on the weighted average

Asynchronous: `side.pull(w)` when a job starts, `side.apply_async(w, message, ...)` on arrival.

    python -m pytest tests/unit/test_outer_side.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from diloco.core.async_rules import AsyncRule
from diloco.core.codec import Codec, Encoded, Fp32Codec, tensor_bytes
from diloco.core.membership import outer_grad_dropped
from diloco.core.outer import Nesterov, OuterOpt, after_each, in_groups, kept_weights, sum_in_order
from diloco.errors import RESUME_OR, NonFinite

PART_BYTES = 64 << 20  # an async apply decodes the outer_grad this many bytes at a time
ON_NONFINITE = ("stop", "drop")  # --on-nonfinite: what a non-finite outer_grad does to the run
AFTER_DROP = ("own", "global")  # --after-drop: where the worker of a dropped outer_grad goes on from


class OuterSide:
    """Global parameters and everything that updates them (see the module docstring).

    `update` is an `OuterOpt` (sync DiLoCo: one step per round on the weighted average) or an
    `AsyncRule` (asynchronous: one application per arriving outer_grad). `weights` default to
    1/k. `drop_prob` loses each outer_grad of a sync round with that probability (drawn from
    (seed, round, worker), so every runtime agrees); its worker then goes on from its own
    parameters (`after_drop` "own") or from the global ones ("global"); `on_nonfinite` says what
    a NaN/Inf outer_grad or loss does: `stop` raises `NonFinite`, `drop` treats it as lost and
    its worker restarts from the global parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        num_workers: int,
        *,
        update: OuterOpt | AsyncRule | None = None,
        codec: Codec | None = None,
        download: Codec | None = None,
        weights: Sequence[float] | None = None,
        drop_prob: float = 0.0,
        after_drop: str = "own",
        seed: int = 0,
        on_nonfinite: str = "stop",
    ):
        k = num_workers
        if k < 1:
            raise ValueError(f"the outer side needs at least one worker, got {k}")
        weights = list(weights) if weights is not None else [1.0 / k] * k
        if len(weights) != k or abs(sum(weights) - 1.0) > 1e-6 or min(weights) < 0:
            raise ValueError(f"weights must be {k} non-negative numbers summing to 1, got {weights}")
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        if after_drop not in AFTER_DROP:
            raise ValueError(f"after_drop must be one of {AFTER_DROP}, got {after_drop!r}")
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.update = update if update is not None else Nesterov()
        self.codec = codec or Fp32Codec()
        self.download = download or Fp32Codec()  # how workers receive θ: fp32, or bf16 (lossy)
        self._downloaded: tuple[int, list[torch.Tensor]] | None = None  # (version, decoded θ)
        self.weights = weights
        self.drop_prob, self.after_drop = drop_prob, after_drop
        self.seed, self.on_nonfinite = seed, on_nonfinite
        self.version = 0  # outer updates applied
        self.rounds_done = 0  # sync rounds finished (with or without an update)
        self.inner_step = 0  # inner steps each (always active) worker has taken, sync
        self.total_steps = 0  # inner steps summed over workers whose outer_grad arrived
        self.worker_steps = [0] * k  # inner steps per worker whose outer_grad arrived (dropped
        # or applied): their sum is total_steps
        self.own_start = [False] * k  # workers that start their next job from their own parameters
        self.bytes_sent = [0] * k  # per worker, cumulative: its encoded outer_grads
        self.bytes_received = [0] * k  # per worker, cumulative: global parameters it pulled
        self.nonfinite_dropped = 0  # outer_grads dropped for NaN/Inf (with on_nonfinite "drop")
        self._active: list[int] = []  # this round's active workers, in order
        self._kept: dict[int, bool] = {}  # reported so far: whose outer_grad counts
        self._arrived: list[int] = []  # workers whose outer_grad of this round arrived (their steps count)
        self._steps: list[int] | None = None  # this round's inner steps per worker (DyLU), by id
        # told of each group of a message's decoded tensors once used (the server: wal.release_read)
        self.after_read: Callable[[Encoded, list[torch.Tensor]], None] = lambda message, tensors: None

    num_workers = property(lambda self: len(self.weights))
    param_bytes = property(lambda self: self.float_bytes(range(len(self.params))))
    pull_bytes = property(lambda self: self.download.message_bytes(self.params))  # one download of θ

    def float_bytes(self, indices: Sequence[int]) -> int:
        """The float32 bytes of the parameters at `indices` (what an all-reduce of them carries)."""
        return tensor_bytes([self.params[i] for i in indices])

    # -- pulls ---------------------------------------------------------------------------------
    def downloaded(self) -> list[torch.Tensor]:
        """The global parameters as a worker receives them: θ itself with the fp32 download
        codec, else decode(encode(θ)) (made once per version). The caller must copy them."""
        if not self.download.lossy:
            return self.params
        if self._downloaded is None or self._downloaded[0] != self.version:
            self._downloaded = (self.version, self.through_download(self.params))
        return self._downloaded[1]

    def through_download(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` as a worker receives them through the download codec."""
        return self.download.decode(self.download.encode(tensors)) if self.download.lossy else tensors

    def pull(self, w: int) -> list[torch.Tensor]:
        """Worker w downloads the global parameters (counted); the caller must copy them."""
        self.count_pull(w)
        return self.downloaded()

    def count_pull(self, w: int) -> None:  # the server makes its own download
        self.bytes_received[w] += self.pull_bytes

    # -- a synchronous round -------------------------------------------------------------------
    def begin_round(
        self, active: int | Sequence[int] | None = None, *, steps: Sequence[int] | None = None
    ) -> list[bool]:
        """Start a round with `active` workers: the first `active` (default all), or these worker
        ids (the parameter server's registered workers). Returns, per active worker in order,
        whether it starts from the global parameters (counting its pull) rather than its own (its
        last outer_grad was dropped). Inactive workers rejoin from the global ones.

        `steps` (sync DiLoCo with DyLU, core/dylu.py): the inner steps each worker takes this
        round, by worker id; unequal, they scale the weights (w_i ∝ weight_i × steps_i). None:
        every worker takes the `inner_steps` given to `end_round`."""
        k = self.num_workers
        if active is None or isinstance(active, int):
            members = list(range(active or k))
        else:
            members = sorted(set(active))
        if not members or not 0 <= members[0] <= members[-1] < k:
            raise ValueError(f"a round needs active workers among 0..{k - 1}, got {active}")
        for w in set(range(k)) - set(members):
            self.own_start[w] = False
        starts = []
        for w in members:
            starts.append(not self.own_start[w])
            if starts[-1]:
                self.bytes_received[w] += self.pull_bytes
        self._active, self._kept, self._arrived = members, {}, []
        self._steps = None if steps is None else list(steps)
        return starts

    def report(
        self, w: int, nbytes: int, finite: bool = True, *, lost: bool = False, steps: int | None = None
    ) -> bool:
        """Worker w's outer_grad of this round was sent (`nbytes`); returns whether it counts.
        Call for every active worker in worker order, before `contribution`. `lost`: it never
        arrived (the parameter server's round timed out, or its worker left): it does not count
        and its worker rejoins from the global parameters. `steps`: the inner steps it took, where
        begin_round planned others (a deadline job of sync DiLoCo with DyLU)."""
        if len(self._kept) >= len(self._active) or w != self._active[len(self._kept)]:
            want = self._active[len(self._kept)] if len(self._kept) < len(self._active) else "none"
            raise ValueError(f"report active workers in order: expected worker {want}, got {w}")
        if steps is not None:
            if self._steps is None:
                raise ValueError("report(steps=...) needs begin_round(steps=...)")
            self._steps[w] = steps
        if lost:
            self._kept[w] = self.own_start[w] = False
            return False
        self.bytes_sent[w] += nbytes
        self._arrived.append(w)
        dropped = outer_grad_dropped(self.seed, self.rounds_done, w, self.drop_prob)
        self.own_start[w] = dropped and self.after_drop == "own"
        if not finite:
            if self.on_nonfinite == "stop":
                raise NonFinite(
                    f"worker {w} produced a non-finite (NaN or Inf) training loss or outer_grad in round "
                    f"{self.rounds_done + 1}; the run stopped before applying it; {RESUME_OR}start again "
                    "with a lower --inner-lr or with --on-nonfinite drop."
                )
            self.nonfinite_dropped += 1
            self.own_start[w] = False  # its own parameters are not finite: restart from θ
            dropped = True
        self._kept[w] = not dropped
        return not dropped

    def round_weights(self) -> list[float]:
        """Each worker's weight this round: kept weights rescaled to sum to 1, 0 for a dropped
        outer_grad or an inactive worker (so an all-reduce of weighted contributions gives the
        average)."""
        kept = [self._kept.get(w, False) for w in range(self.num_workers)]
        if not any(kept):
            return [0.0] * len(kept)
        weights = self.weights
        if self._steps is not None and len({self._steps[w] for w in self._active}) > 1:
            scaled = [x * n for x, n in zip(self.weights, self._steps, strict=True)]
            weights = [x / sum(scaled) for x in scaled]
        it = iter(kept_weights(weights, kept))
        return [next(it) if c else 0.0 for c in kept]

    def contribution(self, w: int, message: Encoded | None) -> list[torch.Tensor]:
        """Worker w's weighted share of the round's sum, w_i × decode(message) in float32; zeros
        if it does not count (dropped, or not active this round). Summed in worker order or by an
        all-reduce: the same bits with two workers, within float rounding with more."""
        return list(self._contribution_each(w, message, self.round_weights()[w]))

    def _contribution_each(self, w: int, message: Encoded | None, weight: float) -> Iterator[torch.Tensor]:
        if message is None or weight == 0.0:
            return (torch.zeros_like(p) for p in self.params)
        return self._weighted_each(message, weight, range(len(self.params)))

    def _weighted_each(
        self, message: Encoded, weight: float, indices: Sequence[int]
    ) -> Iterator[torch.Tensor]:
        """weight × decode(message) in float32 for the parameters at `indices`, one at a time."""
        decoded = self.codec.decode_each(message)
        for i in indices:
            t = next(decoded, None)
            if t is None:
                raise ValueError(f"a message of fewer tensors than its {len(indices)} parameters")
            out = torch.zeros_like(self.params[i]).add_(t, alpha=weight)
            self.after_read(message, [t])
            yield out
        if next(decoded, None) is not None:
            raise ValueError(f"a message of more tensors than its {len(indices)} parameters")

    def reduce(self, messages: Sequence[Encoded | None]) -> list[torch.Tensor]:
        """The sum of every active worker's contribution in worker order (the simulator's
        all-reduce), worker by worker and tensor by tensor: never k decoded messages at once."""
        weights = self.round_weights()
        parts = (self._contribution_each(w, m, weights[w]) for w, m in enumerate(messages))
        return sum_in_order(parts, self.params)

    def end_round(self, summed: list[torch.Tensor], inner_steps: int) -> bool:
        """Apply the outer step on the summed contributions (if any outer_grad counted); every
        active worker ran `inner_steps` (counted for those whose outer_grad arrived), or, given
        `steps` at begin_round, its own (`inner_steps` is then how far the per-worker step count
        `inner_step` advances). Returns whether θ changed."""
        changed = any(self._kept.values())
        if changed:
            self.update.step(self.params, summed)
            self.version += 1
        self.rounds_done += 1
        self.inner_step += inner_steps
        for w in self._arrived:
            taken = inner_steps if self._steps is None else self._steps[w]
            self.total_steps += taken
            self.worker_steps[w] += taken
        self._arrived = []
        return changed

    # -- Streaming DiLoCo (streaming.py): one fragment at a time, every worker, no drops --------
    def fragment_contribution(self, w: int, message: Encoded, group: list[int]) -> list[torch.Tensor]:
        """Worker w's weighted share of fragment `group`'s sum (float32), as `contribution`."""
        return list(self._weighted_each(message, self.weights[w], group))

    def reduce_fragment(
        self, messages: Sequence[Encoded | None], group: list[int]
    ) -> list[torch.Tensor] | None:
        """Σ_w w_i × decode(message_w) in worker order (as `reduce`). A None message did not come
        (the parameter server closed the fragment without a late worker's): the weights of those
        that came are rescaled to sum to 1; None if none came."""
        kept = [m is not None for m in messages]
        if not any(kept):
            return None
        weights = iter(kept_weights(self.weights, kept))
        parts = (self._weighted_each(m, next(weights), group) for m in messages if m is not None)
        return sum_in_order(parts, [self.params[i] for i in group])

    def sent_fragment(self, w: int, nbytes: int, finite: bool) -> None:
        """Worker w sent a fragment's outer_grad of `nbytes`; a non-finite one stops the run."""
        self.bytes_sent[w] += nbytes
        self.stop_if_nonfinite(w, finite)

    def stop_if_nonfinite(self, w: int, finite: bool, round_: int | None = None) -> None:
        """Streaming DiLoCo stops on worker w's non-finite loss or outer_grad in round `round_`
        (default: the one under way) before the round is checkpointed."""
        if not finite:
            raise NonFinite(
                f"worker {w} produced a non-finite (NaN or Inf) training loss or outer_grad in round "
                f"{round_ or self.rounds_done + 1}; the run stopped before applying it; {RESUME_OR}start "
                "again with a lower --inner-lr."
            )

    def end_fragment(self, p: int, group: list[int], summed: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Fragment p's outer step on the summed contributions (None: none came, no step); returns
        the fragment as workers download it (through the download codec), counting each worker's
        download."""
        fragment = [self.params[i] for i in group]
        if summed is not None:
            self.update.step_part(p, fragment, summed)
        fragment = self.through_download(fragment)
        nbytes = self.download.message_bytes(fragment)
        for w in range(self.num_workers):
            self.bytes_received[w] += nbytes
        return [t.detach().clone() for t in fragment]

    def end_streaming_round(self, inner_steps: int, workers: Sequence[int] | None = None) -> None:
        """Every fragment of the round was merged: one more version and round; `workers` (default
        all) ran its `inner_steps`."""
        self.version += 1
        self.rounds_done += 1
        self.inner_step += inner_steps
        for w in range(self.num_workers) if workers is None else workers:
            self.total_steps += inner_steps
            self.worker_steps[w] += inner_steps

    # -- asynchronous --------------------------------------------------------------------------
    def apply_async(
        self,
        w: int,
        message: Encoded,
        *,
        steps: int,
        staleness: int,
        finite: bool = True,
        pulled: list[torch.Tensor] | None = None,
        group_end: bool = True,
    ) -> bool:
        """Apply worker w's outer_grad at once with the async rule; returns whether θ changed.
        `group_end`: it is the last of its grace group (or stands alone). Decoded PART_BYTES at
        a time (`dn` applies each part as it comes: a 150m fp4 push is never 600 MB of float32)."""
        self.bytes_sent[w] += message.nbytes
        self.total_steps += steps
        self.worker_steps[w] += steps
        if not finite:
            if self.on_nonfinite == "stop":
                raise NonFinite(
                    f"worker {w} produced a non-finite (NaN or Inf) training loss or outer_grad in its job "
                    f"arriving at version {self.version}; the run stopped before applying it; {RESUME_OR}"
                    "start again with a lower --inner-lr or with --on-nonfinite drop."
                )
            self.nonfinite_dropped += 1
            return False
        parts = in_groups(self.codec.decode_each(message), PART_BYTES)
        changed = self.update.apply_parts(
            self.params,
            after_each(parts, partial(self.after_read, message)),
            worker=w,
            staleness=staleness,
            pulled=pulled,
            group_end=group_end,
        )
        self.version += int(changed)
        return changed

    def flush(self) -> bool:
        """Apply what an async rule still holds back at the end (a part-filled buffer)."""
        changed = self.update.flush(self.params)
        self.version += int(changed)
        return changed

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "global": self.model.state_dict(),
            "update": self.update.state_dict(),
            "version": self.version,
            "rounds_done": self.rounds_done,
            "inner_step": self.inner_step,
            "total_steps": self.total_steps,
            "worker_steps": list(self.worker_steps),
            "own_start": list(self.own_start),
            "bytes_sent": list(self.bytes_sent),
            "bytes_received": list(self.bytes_received),
            "nonfinite_dropped": self.nonfinite_dropped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        k = self.num_workers
        if len(state["own_start"]) != k:
            raise ValueError(f"the checkpoint has {len(state['own_start'])} workers, this run {k}")
        self.model.load_state_dict(state["global"])
        self._downloaded = None
        self.update.load_state_dict(state["update"])
        for key in ("version", "rounds_done", "inner_step", "total_steps", "nonfinite_dropped"):
            setattr(self, key, int(state[key]))
        self.own_start = [bool(x) for x in state["own_start"]]
        self.bytes_sent = [int(b) for b in state["bytes_sent"]]
        self.bytes_received = [int(b) for b in state["bytes_received"]]
        # checkpoints from before worker_steps: every worker's share of the steps
        self.worker_steps = [int(n) for n in state.get("worker_steps", [self.total_steps // k] * k)]
