"""Streaming DiLoCo through the parameter server (sync; docs/server.md, "Streaming DiLoCo"): the
coordinator's fragment events, a part of `Coordinator` (coordinator.py).

A round's job runs the schedule's segments on its worker (core/streaming.py, as the simulator and
the collective runtime do): the worker pushes fragment p's outer_grad at its send step ⌊(p + 1)
H / P⌋ − τ and goes on training; at the merge step, τ steps later, it asks for the fragment's new
global values (GetFragment) and mixes them in with α. The server takes fragment p's outer step
(with the fragment's own outer optimizer) once every member whose job is alive has pushed it, or
once the round's timeout passed: a late member's fragment is then dropped for the round, the
weights of those that came rescaled to sum to 1. A worker keeps its own θ from round to round
(its next job comes without parameters, `keep`); one whose last fragment had not come when the
round closed is made to leave (reason "late") and joins again as a fresh worker, which gets θ.

Events (coordinator.py lists them all):

    dispatch {..., round, keep}    a round's job; `keep`: no θ is sent, the worker goes on
    push     {..., fragment}       fragment p of the job's outer_grad (the last one ends the job)
    fragment {round, fragment}     fragment p's outer step on what arrived
    close    {round}               every fragment closed: the round ends (one version more)
"""

from __future__ import annotations

from typing import Any

import torch

from diloco.core.codec import Encoded
from diloco.core.streaming import Schedule, fragment_groups
from diloco.runtime import RoundStats


class FragmentRounds:
    """The Streaming DiLoCo part of the coordinator (`schedule` None: plain rounds)."""

    def _setup_fragments(self) -> None:
        self.schedule: Schedule | None = self.cfg.streaming.build()
        self.groups = fragment_groups(self.side.model, self.schedule.fragments) if self.schedule else []
        self.fragment_in: dict[int, dict[int, tuple[dict, Encoded]]] = {}  # p -> worker -> its push
        self.closed = 0  # fragments of the round under way whose outer step is taken
        self.last_pushes: dict[int, dict] = {}  # worker -> its last fragment's push, this round
        # the round of each fragment's latest outer step: θ's fragment p is that round's result
        # until the next round's step on it (so a worker merges it from θ itself, GetFragment)
        self.fragment_round = [0] * len(self.groups)

    def merged(self, round_: int, p: int) -> list[torch.Tensor] | None:
        """Fragment p of round `round_` as a worker merges it (θ's, through the download codec;
        the caller must copy them), or None: its outer step is not taken yet, or it was taken
        again since (the round is over). Lock held."""
        if self.fragment_round[p] != round_:
            return None
        return self.side.through_download([self.side.params[i] for i in self.groups[p]])

    def fragment_ready(self, p: int) -> bool:
        """Whether every member whose job is alive has pushed fragment p. Lock held."""
        arrived = self.fragment_in.get(p, {})
        return all(job.worker in arrived for job in self.jobs.values())

    def fragment_pushed(self, w: int, p: int) -> bool:
        """Whether worker w's fragment p of the round under way is in (a retry: a duplicate)."""
        return w in self.fragment_in.get(p, {})

    def _fragment_push(self, e: dict[str, Any], message: Encoded) -> None:
        job, p = self.jobs[e["job"]], e["fragment"]
        self.fragment_in.setdefault(p, {})[job.worker] = (e, message)
        if p == self.schedule.fragments - 1:  # its last: the job is done
            del self.jobs[job.job]
            self.last_pushes[job.worker] = e
            self._job_done(job, e)

    def _on_fragment(self, e: dict[str, Any], _) -> None:
        p, side = e["fragment"], self.side
        if p != self.closed:
            raise ValueError(f"fragment {p} closes after {self.closed} of round {e['round']}")
        arrived = self.fragment_in.pop(p, {})
        messages: list[Encoded | None] = []
        for w in range(self.k):  # in worker order, as the simulator
            if w in arrived:
                push, message = arrived[w]
                side.sent_fragment(w, message.nbytes, push["finite"])
                messages.append(message)
            else:
                messages.append(None)
        group = self.groups[p]
        side.end_fragment(p, group, side.reduce_fragment(messages, group))
        self.fragment_round[p] = e["round"]
        self.closed += 1

    def _close_streaming(self, e: dict[str, Any]) -> RoundStats:
        """The round's end: its members whose last fragment came ran H steps and keep their θ."""
        side = self.side
        done = sorted(w for w in self.members if w in self.last_pushes)
        side.end_streaming_round(self.H, workers=done)
        for w in done:
            if w in self.workers:
                self.workers[w]["holds"] = True  # its next job comes without θ
        losses = [self.last_pushes[w]["loss"] for w in done]
        lr = self.last_pushes[done[-1]]["lr"] if done else 0.0
        for job in list(self.jobs.values()):  # none: the server made late members leave
            del self.jobs[job.job]
            self.workers[job.worker]["job"] = None
        self.members, self.closed, self.fragment_in, self.last_pushes = [], 0, {}, {}
        return RoundStats(
            side.version,
            side.inner_step,
            losses,
            lr,
            list(side.bytes_sent),
            list(side.bytes_received),
            workers=done,
        )
