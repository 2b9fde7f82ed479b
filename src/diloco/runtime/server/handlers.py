"""The parameter server's gRPC handlers: each call runs on a thread of the server's pool, takes
the runtime's lock (service.py) to read the coordinator or record an event, and does its
copying, encoding and decoding outside it. Every call but Register carries the worker's slot,
the run's id and its registration's token, so an earlier holder of the slot is refused.

    python -m pytest tests/integration/test_server.py
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

import grpc

from diloco.codec import Encoded
from diloco.errors import NonFinite, UserError
from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server import diloco_pb2_grpc as rpc

if TYPE_CHECKING:
    from diloco.runtime.server.service import ServerRuntime

PROTOCOL = 1  # bumped when the messages change meaning
CHUNK_BYTES = 1 << 20  # a stream's chunks stay well under gRPC's 4 MB message limit
LONG_POLL_S = 5.0  # a worker asking for a job waits this long for one before being told to ask again


def log(text: str) -> None:
    print(f"diloco serve: {text}", file=sys.stderr, flush=True)


class Handlers(rpc.ParameterServerServicer):
    """The gRPC handlers: each runs on a thread of the server's pool."""

    def __init__(self, rt: ServerRuntime):
        self.rt = rt

    def _check(self, run_id: str, ctx) -> None:
        if run_id != self.rt.run_id:
            ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server now runs another run ({self.rt.run_dir}); restart the worker to join it",
            )

    def _touch(self, w: int, token: int) -> bool:
        """Renew worker w's lease if it is the registration that got `token`; whether it is."""
        known = self.rt.coord.known(w, token)
        if known:
            self.rt.last_seen[w] = time.monotonic()
        return known

    def Register(self, request, ctx):
        rt = self.rt
        if request.protocol != PROTOCOL:
            ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server speaks protocol {PROTOCOL}, the worker {request.protocol}; "
                "run the same diloco on both",
            )
        with rt.cond:
            if rt.coord.finished:
                return pb.RegisterReply(status=pb.RegisterReply.DONE)
            again = [
                w for w, rec in rt.coord.workers.items() if request.nonce and rec["nonce"] == request.nonce
            ]
            w = again[0] if again else rt.coord.free_slot()  # a retried Register gets its slot again
            if w is None:
                return pb.RegisterReply(status=pb.RegisterReply.FULL, retry_s=1.0)
            if not again:
                event = {"kind": "join", "worker": w, "name": request.name, "device": request.device}
                rt._record({**event, "nonce": request.nonce})
                log(f"worker {w} joined ({request.name}, {request.device})")
            rt.last_seen[w] = time.monotonic()
            token = rt.coord.workers[w]["token"]
        return pb.RegisterReply(
            status=pb.RegisterReply.OK,
            worker=w,
            run_id=rt.run_id,
            config_json=json.dumps(rt.cfg.to_dict()),
            shard_tokens=rt.coord.shard_sizes,
            heartbeat_s=max(0.1, rt.cfg.worker_timeout_s / 4),
            token=token,
        )

    def GetJob(self, request, ctx):
        rt, w = self.rt, request.worker
        self._check(request.run_id, ctx)
        limit = time.monotonic() + LONG_POLL_S
        with rt.cond:
            while True:
                known = self._touch(w, request.token)
                if rt.coord.finished:
                    rt.told_done.add(request.token)
                    yield_header, job = pb.JobChunk(status=pb.JobChunk.DONE), None
                    break
                if not known:
                    yield_header, job = pb.JobChunk(status=pb.JobChunk.UNKNOWN_WORKER), None
                    break
                jid = rt.coord.workers[w]["job"]
                if jid is not None and jid in rt.coord.jobs:
                    job = rt.coord.jobs[jid]
                    yield_header = None
                    break
                if time.monotonic() >= limit:
                    yield_header, job = pb.JobChunk(status=pb.JobChunk.WAIT, retry_s=0.0), None
                    break
                rt.cond.wait(1.0)
        if job is None:
            yield yield_header
            return
        blob = rt.params_blob(job)
        rt.wire[w]["received"] += len(blob)
        yield pb.JobChunk(
            status=pb.JobChunk.RUN,
            job=job.job,
            steps=job.steps,
            shard=job.shard,
            lr_step=job.lr_step,
            version=job.version,
            total_bytes=len(blob),
        )
        for at in range(0, len(blob), CHUNK_BYTES):
            yield pb.JobChunk(data=blob[at : at + CHUNK_BYTES])

    def Push(self, request_iterator, ctx):
        rt = self.rt
        head = next(request_iterator, None)
        if head is None:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty push; send a header chunk first")
        self._check(head.run_id, ctx)
        blob = b"".join([head.data, *(chunk.data for chunk in request_iterator)])
        w, jid = head.worker, head.job
        if len(blob) != head.total_bytes:
            ctx.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"push of job {jid} has {len(blob)} bytes, its header says {head.total_bytes}; resend it",
            )
        with rt.cond:
            self._touch(w, head.token)
            verdict = self._verdict(w, head.token, jid)
        if verdict is not None:
            return verdict
        if not head.finite and rt.cfg.on_nonfinite == "stop":  # not logged: a resume can go past it
            with rt.cond:
                rt.failure = NonFinite(
                    f"worker {w} produced a non-finite (NaN or Inf) training loss or outer_grad in job "
                    f"{jid}; the run stopped before applying it and its last checkpoint is intact: --resume "
                    "it if the cause was passing, or start again with a lower --inner-lr or with "
                    "--on-nonfinite drop."
                )
                rt.cond.notify_all()
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "the run stopped on a non-finite outer_grad")
        try:
            message = Encoded.from_bytes(blob)
            rt.side.codec.check(message)
        except UserError as e:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        want = [tuple(p.shape) for p in rt.side.params]
        got = [tuple(t.shape) for t in message.payload]
        if rt.side.codec.summable and got != want:
            ctx.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"job {jid}'s outer_grad does not fit this model's parameters",
            )
        with rt.cond:
            verdict = self._verdict(w, head.token, jid)
            if verdict is not None:
                return verdict
            job = rt.coord.jobs[jid]
            event = {
                "kind": "push",
                "job": jid,
                "worker": w,
                "steps": job.steps,
                "loss": head.mean_loss,
                "lr": head.last_lr,
                "compute_s": head.compute_s,
                "finite": head.finite,
                "nbytes": message.nbytes,
            }
            rt._record(event, blob, message)
            rt.wire[w]["sent"] += len(blob)
        return pb.PushReply(status=pb.PushReply.ACCEPTED)

    def _verdict(self, w: int, token: int, jid: int):
        """The reply to a push that is not accepted now (None: accept it). Lock held."""
        rt = self.rt
        if jid in rt.coord.pushed:
            return pb.PushReply(status=pb.PushReply.DUPLICATE, reason=f"job {jid} was accepted before")
        job = rt.coord.jobs.get(jid)
        if job is None or job.worker != w or not rt.coord.known(w, token):
            if job is None and jid < rt.coord.next_job and jid not in rt.coord.late:
                rt._record({"kind": "late", "job": jid, "worker": w})
            return pb.PushReply(
                status=pb.PushReply.LATE, reason=f"job {jid} was abandoned (round closed or lease ran out)"
            )
        return None

    def Heartbeat(self, request, ctx):
        self._check(request.run_id, ctx)
        with self.rt.cond:
            return pb.HeartbeatReply(known=self._touch(request.worker, request.token))

    def Leave(self, request, ctx):
        self._check(request.run_id, ctx)
        with self.rt.cond:
            if self.rt.coord.known(request.worker, request.token):
                self.rt._leave(request.worker, "left")
            self.rt.may_call.discard(request.token)
        return pb.LeaveReply()
