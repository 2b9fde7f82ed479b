"""A Streaming DiLoCo job of a parameter server's worker (docs/server.md, "Streaming DiLoCo"): the
round's segments (core/streaming.py), as the simulator and the collective runtime run them. At a
fragment's send step its outer_grad is pushed from a background thread while the worker goes on
training; at its merge step, τ steps later, the worker waits for that push's answer and asks the
server for the fragment's new global values (GetFragment), which it mixes in with α. A job
handed out with θ (the worker's first, or after its job was dropped) starts from θ and measures
its outer_grads from it; later jobs (`keep`) go on from the worker's own parameters.

    diloco serve --fragments 4 --overlap-steps 5 ...; diloco worker --server HOST:PORT
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from diloco.core.codec import Encoded
from diloco.core.inner import Worker
from diloco.core.streaming import fragment_groups
from diloco.errors import UserError
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
                    status = group.lead(lambda p=seg.merge: pushes.pop(p).result())
                    if status == "refused":
                        return "done"
                    tensors = _fetch(link, ref, head.round, seg.merge, group, download, over)
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
                        compute_s=time.perf_counter() - t0 - waited,
                        version=head.version,
                        fragment=seg.send + 1,
                    )
                    message = result.message.to_bytes() if group.leader else b""
                    header.total_bytes = len(message)
                    pushes[seg.send] = pool.submit(push, header, message) if group.leader else _none()
        except _Rejoin:
            return "rejoin"
    return "done"


def _none() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def _fetch(link, ref, round_: int, p: int, group: Group, download, over) -> list[torch.Tensor]:
    """Fragment p of the round as the server has it after its outer step (every rank)."""
    got: list[bytes] = []

    request = pb.FragmentRef(worker=ref.worker, run_id=ref.run_id, token=ref.token, round=round_, fragment=p)

    def ask() -> tuple[int, int]:
        while True:
            head, blob = link.call(f"fragment {p}", lambda: _get(link, request), over)
            if head.status == pb.JobChunk.WAIT:
                continue
            got.append(blob)
            return head.status, len(blob)

    status, nbytes = group.lead(ask)
    if status == pb.JobChunk.DONE:
        raise RunOver
    if status in (pb.JobChunk.UNKNOWN_WORKER, pb.JobChunk.GONE):
        raise _Rejoin
    blob = group.share(got[0] if got else None, nbytes)
    return download.decode(Encoded.from_bytes(blob))


def _get(link: Link, request: pb.FragmentRef) -> tuple[pb.JobChunk, bytes]:
    chunks = link.stub.GetFragment(request, timeout=120.0, metadata=link.meta)
    head = next(chunks)
    blob = b"".join(chunk.data for chunk in chunks)
    if head.status == pb.JobChunk.RUN and len(blob) != head.total_bytes:
        raise UserError(f"fragment {request.fragment} came with {len(blob)} bytes, not {head.total_bytes}")
    return head, blob
