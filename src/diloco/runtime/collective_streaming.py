"""Streaming DiLoCo (docs/method.md §3) in the collective runtime: a round's segments on this rank's
worker, each fragment's exchange started as an asynchronous collective when its segment ends and
waited for at its merge, τ inner steps later. `CollectiveDiLoCo` (collective.py) takes these
rounds when it is given a schedule.

    torchrun --standalone --nproc-per-node 2 -m diloco train --runtime collective --fragments 2 \
--overlap-steps 5
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from diloco.core.codec import Encoded
from diloco.core.streaming import Schedule, fragment_groups
from diloco.runtime import RoundStats


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like each of `like`, in order (a summed flat buffer as tensors)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


class StreamingRounds:
    """The Streaming DiLoCo rounds of `CollectiveDiLoCo`, which provides the outer side, the
    worker, the groups and the collectives these methods use."""

    def _setup_streaming(self, schedule: Schedule | None) -> None:
        self.schedule = schedule  # Streaming DiLoCo, or None
        if schedule is not None:
            self.groups = fragment_groups(self.side.model, schedule.fragments)
            self._anchored = False  # this worker knows the global θ it measures outer_grads from
            self._blob_len: dict[int, int] = {}  # fragment -> its encoded message's length

    def _streaming_round(self) -> RoundStats:
        """The schedule's segments on this rank's worker. A fragment's exchange starts as an
        asynchronous collective (`async_op=True`) when its segment ends and is waited for at its
        merge, τ inner steps later; only that wait counts as communication time."""
        side, sched, H, k = self.side, self.schedule, self.cfg.inner_steps, self.k
        t0 = time.perf_counter()
        before = list(self.rank_bytes)
        comm_s, total_loss, lr = 0.0, 0.0, 0.0
        in_flight: dict[int, tuple] = {}
        for n, seg in enumerate(sched.segments()):
            kwargs: dict[str, Any] = {}
            if n == 0 and not self._anchored:
                kwargs["anchor"] = side.downloaded()
                if side.rounds_done == 0:  # the first pull; after a resume workers hold their own θ
                    kwargs["start"] = [side.pull(i) for i in range(k)][self.worker_id]
            self._anchored = True
            if seg.merge is not None:
                waited = time.perf_counter()
                with self._collective("a fragment's exchange"):
                    fragment = self._land(seg.merge, *in_flight.pop(seg.merge))
                comm_s += time.perf_counter() - waited
                kwargs["merge"] = (self.groups[seg.merge], fragment, sched.alpha)
            if seg.send is not None:
                kwargs["send"] = (seg.send, self.groups[seg.send])
            result = self.worker.segment(seg.steps, **kwargs)
            total_loss += result.mean_loss * seg.steps
            lr = result.last_lr if seg.steps else lr
            if seg.send is not None:
                started = time.perf_counter()
                with self._collective("starting a fragment's exchange"):
                    in_flight[seg.send] = self._launch(seg.send, result)
                comm_s += time.perf_counter() - started
        side.end_streaming_round(H)
        compute_s = time.perf_counter() - t0 - comm_s
        stats = self._finish_round(total_loss / H, lr, compute_s, comm_s, before, k)
        # a NaN in steps after the last send is in no exchange: every rank learns it here, from
        # the gathered losses, and stops before the round's checkpoint
        for i, loss in enumerate(stats.losses):
            side.stop_if_nonfinite(i, math.isfinite(loss), round_=side.rounds_done)
        return stats

    def _launch(self, p: int, result) -> tuple:
        """Start fragment p's exchange among the worker leaders: an all-reduce of this worker's
        float32 contribution (summable codecs) or an all-gather of its encoded message, plus an
        all-reduce of every worker's message size and finiteness. Returns the pending work."""
        side, group, w, k = self.side, self.groups[p], self.worker_id, self.k
        info = torch.zeros(2 * k, dtype=torch.int64)
        info[w], info[k + w] = result.message.nbytes, int(not result.finite)
        if side.codec.summable:
            payload = torch.cat([t.reshape(-1) for t in side.fragment_contribution(w, result.message, group)])
            buffers = [payload]
        else:
            blob = result.message.to_bytes()
            if p not in self._blob_len:  # the same for every worker: same shapes, same codec
                zeros = [torch.zeros_like(self.params[i]) for i in group]
                self._blob_len[p] = len(side.codec.encode(zeros, None).to_bytes())
            if len(blob) != self._blob_len[p]:
                raise RuntimeError(f"fragment {p}'s message has {len(blob)} bytes, not {self._blob_len[p]}")
            payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            buffers = [torch.empty_like(payload) for _ in range(k)]
        works = []
        if self.local == 0:
            if side.codec.summable:
                works.append(
                    dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.leaders, async_op=True)
                )
                nbytes = payload.numel() * payload.element_size()
                self.rank_bytes[0] += nbytes
                self.rank_bytes[1] += nbytes
            else:
                works.append(dist.all_gather(buffers, payload, group=self.leaders, async_op=True))
                self.rank_bytes[0] += payload.numel()
                self.rank_bytes[1] += payload.numel() * k
            works.append(dist.all_reduce(info, op=dist.ReduceOp.SUM, group=self.leaders, async_op=True))
        return works, buffers, info

    def _land(
        self, p: int, works: list, buffers: list[torch.Tensor], info: torch.Tensor
    ) -> list[torch.Tensor]:
        """Wait for fragment p's exchange, share it inside the worker, take the fragment's outer
        step; returns the fragment as this worker merges it."""
        side, group, k = self.side, self.groups[p], self.k
        for work in works:
            work.wait()
        for t in (*buffers, info):
            self._share_in_worker(t, t.numel() * t.element_size())
        for i in range(k):
            side.sent_fragment(i, int(info[i]), not bool(info[k + i]))
        if side.codec.summable:
            summed = unflatten(buffers[0], [self.params[i] for i in group])
        else:
            messages = [Encoded.from_bytes(b.numpy().tobytes()) for b in buffers]
            summed = side.reduce_fragment(messages, group)
        return side.end_fragment(p, group, summed)
