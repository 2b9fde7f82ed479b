"""A Streaming DiLoCo job of a parameter server's worker (docs/server.md, "Streaming DiLoCo"): the
round's segments (core/streaming.py), as the simulator and the collective runtime run them. At a
fragment's send step a background thread pushes its outer_grad and then asks the server for the
fragment's new global values (GetFragment, which answers once every worker's fragment is in and
the outer step taken) while the worker goes on training; at the merge step, τ steps later, the
worker takes them (waiting for what the τ steps did not hide) and mixes them in with α. A job
handed out with θ (the worker's first, or after its job was dropped) starts from θ and measures
its outer_grads from it; later jobs (`keep`) go on from the worker's own parameters.

    diloco serve --fragments 4 --overlap-steps 5 ...; diloco worker --server HOST:PORT
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from diloco.core.codec import Encoded
from diloco.core.inner import Worker
from diloco.core.streaming import fragment_groups
from diloco.run.assemble import download_codec
from diloco.run.group import Group
from diloco.run.link import Link, RunOver
from diloco.runtime.server import diloco_pb2 as pb

# the job's end: "done", or "rejoin" (the server dropped this worker: it joins again as a fresh one)
Outcome = str


class _Rejoin(Exception):
    """The server no longer knows this worker, or its round is gone."""


def streaming_job(
    link: Link | None,
    ref: pb.WorkerRef,
    worker: Worker,
    head: pb.JobChunk,
    start: list[torch.Tensor] | None,
    cfg,
    group: Group,
    over,
    push: Callable[[pb.PushChunk, bytes], str],
) -> Outcome:
    """Run `head`'s round on `worker` (every rank of a group; the leader talks to the server);
    `push(header, message)` pushes one fragment (the leader) and says "acked", "late" or
    "refused". A refused fragment ends the job there: the server sends θ with the next one."""
    schedule = cfg.streaming.build()
    model = getattr(worker.model, "module", worker.model)  # inside DistributedDataParallel
    groups = fragment_groups(model, schedule.fragments)
    download = download_codec(cfg)
    worker.batches.seek(head.shard, head.position)
    worker.step = head.lr_step  # the run's lr schedule, for a worker that joins mid-run too
    pushes: dict[int, Future] = {}
    t0, waited, total, done = time.perf_counter(), 0.0, 0.0, 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="push") as pool:
        try:
            for n, seg in enumerate(schedule.segments()):
                kwargs: dict = {}
                if n == 0 and start is not None:  # handed θ: start from it, measure from it
                    kwargs["start"], kwargs["anchor"] = start, start
                if seg.merge is not None:
                    began = time.perf_counter()
                    got: list[bytes] = []
                    pushed, status, nbytes = group.lead(
                        lambda p=seg.merge, got=got: _landed(pushes.pop(p), got)
                    )
                    if pushed == "refused":
                        return "done"
                    if status == pb.JobChunk.DONE:
                        raise RunOver
                    if status in (pb.JobChunk.UNKNOWN_WORKER, pb.JobChunk.GONE):
                        raise _Rejoin
                    blob = group.share(got[0] if got else None, nbytes)
                    tensors = download.decode(Encoded.from_bytes(blob))
                    kwargs["merge"] = (groups[seg.merge], tensors, schedule.alpha)
                    waited += time.perf_counter() - began
                if seg.send is not None:
                    kwargs["send"] = (seg.send, groups[seg.send])
                result = worker.segment(seg.steps, **kwargs)
                total, done = total + result.mean_loss * seg.steps, done + seg.steps
                if seg.send is not None:
                    group.check_same(result.message, head.job)
                    header = pb.PushChunk(
                        worker=ref.worker,
                        run_id=ref.run_id,
                        token=ref.token,
                        job=head.job,
                        steps=head.steps,
                        mean_loss=total / max(1, done),  # its steps so far
                        last_lr=result.last_lr,
                        finite=result.finite,
                        # its compute so far per step × the job's steps: the last push comes τ
                        # steps before the job's end (the server's measured speed and utilisation)
                        compute_s=(time.perf_counter() - t0 - waited) / max(1, done) * head.steps,
                        version=head.version,
                        fragment=seg.send + 1,
                    )
                    message = result.message.to_bytes() if group.leader else b""
                    header.total_bytes = len(message)
                    if group.leader:  # push it, then fetch the fragment's new values, meanwhile
                        fetch = functools.partial(_fetch, link, ref, head.round, seg.send, over)
                        pushes[seg.send] = pool.submit(_exchange, push, header, message, fetch)
        except _Rejoin:
            return "rejoin"
    return "done"


def _exchange(push, header: pb.PushChunk, message: bytes, fetch) -> tuple[str, int, bytes]:
    """A fragment's exchange, on the background thread (the leader): the push's answer ("acked",
    "late" or "refused"), then (unless refused) the fragment's status and bytes from the server."""
    pushed = push(header, message)
    if pushed == "refused":
        return pushed, pb.JobChunk.RUN, b""
    return (pushed, *fetch())


def _landed(exchange: Future, got: list[bytes]) -> tuple[str, int, int]:
    """Wait for a fragment's exchange (the leader); keeps its bytes in `got` for the other ranks."""
    pushed, status, blob = exchange.result()
    got.append(blob)
    return pushed, status, len(blob)


def _fetch(link: Link, ref: pb.WorkerRef, round_: int, p: int, over) -> tuple[int, bytes]:
    """Fragment p of the round from the server once its outer step is taken: (status, bytes)."""
    request = pb.FragmentRef(worker=ref.worker, run_id=ref.run_id, token=ref.token, round=round_, fragment=p)
    while True:
        head, blob = link.call(
            f"fragment {p}", lambda: link.download("GetFragment", request, f"fragment {p}"), over
        )
        if head.status != pb.JobChunk.WAIT:
            return head.status, blob
