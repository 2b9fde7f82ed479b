"""Streaming DiLoCo (docs/method.md §3) in `DistributedDiLoCo`, a user's own loop: the user's
`step()` calls drive the schedule (core/streaming.py). At fragment p's send step S_p its
outer_grad is encoded and its exchange started as an asynchronous collective; at its merge step
M_p = S_p + τ the exchange is waited for, the fragment's outer step taken and the result merged
into the user's model, θ_frag ← α·θ_frag + (1 − α)·θ_global (replaced when τ = 0). The exchanges
are the collective runtime's (`StreamingRounds._launch`, `_land`), so with the same model, data
and seed the global parameters equal the simulator's Streaming DiLoCo (tested in
tests/integration/test_distributed_library.py).

    outer = DistributedDiLoCo(model, inner_steps=100, fragments=4, overlap_steps=5)
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from diloco.core.inner import encode_outer_grad, merge_into, outer_grad_from
from diloco.core.streaming import Schedule
from diloco.errors import NonFinite
from diloco.runtime.collective_streaming import StreamingRounds


class StreamingSteps(StreamingRounds):
    """The streaming side of `DistributedDiLoCo` (distributed.py), which provides the outer side
    (its update `Fragmented`), the process groups, the parameters and the step count. A
    worker's first process (its leader) encodes and exchanges each fragment, then shares the
    result with its worker's other processes, which merge it alike."""

    def _setup_schedule(self, schedule: Schedule | None) -> None:
        self._setup_streaming(schedule)
        self.rank_bytes = [0, 0]  # this process's payload bytes (sent, received), as the collective runtime's
        self._in_flight: dict[int, tuple] = {}  # fragment -> its exchange, started and not yet merged
        if schedule is not None:
            P = schedule.fragments  # each fragment sends and merges at a step of its own
            self._sends = {schedule.send_step(p): p for p in range(P)}
            self._merges = {schedule.merge_step(p): p for p in range(P)}

    def _schedule_key(self) -> list | None:
        """What a checkpoint must match: [fragments, overlap_steps, α], None for plain DiLoCo."""
        s = self.schedule
        return None if s is None else [s.fragments, s.overlap_steps, s.alpha]

    def _other_schedule(self, theirs: list | None, dylu: bool) -> str:
        def name(key: list | None, dylu: bool) -> str:
            what = "plain DiLoCo" if key is None else "fragments={}, overlap_steps={}, α={}".format(*key)
            return what + (" with DyLU" if dylu else "")

        mine = name(self._schedule_key(), self.planner is not None)
        return (
            f"the checkpoint is of {name(theirs, dylu)}, this DistributedDiLoCo of {mine}: build it as "
            "the checkpoint's was; nothing was loaded"
        )

    def _refuse_in_flight(self, call: str) -> None:
        if self._in_flight:
            raise RuntimeError(
                f"fragment {min(self._in_flight)}'s exchange is in flight at step {self.steps_in_round} "
                f"of the round (between its send and its merge): call {call} at another step, e.g. "
                "when step() returns True"
            )

    def _share_in_worker(self, tensor: torch.Tensor, nbytes: int) -> None:
        """The leader's `tensor` to every process of its worker (a worker of several)."""
        if self.M > 1:
            dist.broadcast(tensor, src=self._leader, group=self.worker_group)
            self.rank_bytes[0 if self.local == 0 else 1] += nbytes

    @torch.no_grad()
    def _streaming_step(self) -> bool:
        """The schedule's events at this step of the round: a send, then a merge (a fragment sent
        at the step another merges: τ = 0 merges the one just sent). True at the round's end."""
        t = self.steps_in_round
        if (p := self._sends.get(t)) is not None:
            self._send(p)
        if (p := self._merges.get(t)) is not None:
            self._merge(p)
        if t < self.inner_steps:
            return False
        # every process ends the round alike; a NaN in the steps after a worker's last send is in
        # no exchange, but is in its model: every process learns of it here
        finite = all(bool(torch.isfinite(p).all()) for p in self.params)
        every = self._gather([t, self._worker_digest(), self._global_digest(), int(finite)])
        self._check_global([int(row[2]) for row in every])
        self._check_worker_replicas([int(row[1]) for row in every])
        bad = [r for r, row in enumerate(every) if not int(row[3])]
        if bad:
            raise NonFinite(
                f"the model of rank {bad[0]} holds a NaN or Inf at the end of round "
                f"{self.side.rounds_done + 1} (after its last fragment was sent; θ_global is finite): "
                "load the last state_dict() and lower the inner lr"
            )
        self.side.end_streaming_round(self.inner_steps)
        self.steps_in_round = 0
        return True

    def _send(self, p: int) -> None:
        group = self.groups[p]
        start, local = [self.side.params[i] for i in group], [self.params[i] for i in group]
        if self.local == 0:
            outer_grad, finite = outer_grad_from(start, local)
            state = self.codec_state.setdefault(f"fragment{p}", {})
            message = encode_outer_grad(self.side.codec, outer_grad, finite, state)
        else:  # a placeholder of the message's size: the leader's result comes at the merge
            message, finite = self.side.codec.encode([torch.zeros_like(g) for g in start], None), True
        self._in_flight[p] = self._launch(p, SimpleNamespace(message=message, finite=finite))

    def _merge(self, p: int) -> None:
        try:
            fragment = self._land(p, *self._in_flight.pop(p))
        except NonFinite:
            raise NonFinite(
                f"a worker's outer_grad of fragment {p} holds a NaN or Inf in round "
                f"{self.side.rounds_done + 1}; that fragment of θ_global is unchanged: lower the inner lr"
            ) from None
        for i, g in zip(self.groups[p], fragment, strict=True):
            merge_into(self.params[i], g, self.schedule.alpha)
