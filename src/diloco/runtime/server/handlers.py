"""The parameter server's gRPC handlers: each call runs on a thread of the server's pool, takes
the state's lock (state.py) to read the coordinator or record an event, and does its
copying, encoding and decoding outside it. Every call but Register carries the worker's slot,
the run's id and its registration's token, so an earlier holder of the slot is refused.

    python -m pytest tests/integration/test_server.py
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import time

import grpc
import torch

from diloco.core.codec import Encoded
from diloco.core.dylu import DEADLINE_CAP
from diloco.errors import NonFinite, UserError
from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server import diloco_pb2_grpc as rpc
from diloco.runtime.server.state import ServerState, log
from diloco.runtime.server.wire import CHUNK_BYTES, PROTOCOL

LONG_POLL_S = 5.0  # a worker asking for a job waits this long for one before being told to ask again


class Handlers(rpc.ParameterServerServicer):
    """The gRPC handlers: each runs on a thread of the server's pool."""

    def __init__(self, st: ServerState):
        self.st = st

    def _check(self, run_id: str, ctx) -> None:
        if run_id != self.st.run_id:
            ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server now runs another run ({self.st.run_dir}); restart the worker to join it",
            )

    def Register(self, request, ctx):
        st = self.st
        if request.protocol != PROTOCOL:
            ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server speaks protocol {PROTOCOL}, the worker {request.protocol}; "
                "run the same diloco on both",
            )
        with st.cond:
            if st.coord.finished:
                return pb.RegisterReply(status=pb.RegisterReply.DONE)
            again = [
                w for w, rec in st.coord.workers.items() if request.nonce and rec["nonce"] == request.nonce
            ]
            w = again[0] if again else st.coord.free_slot()  # a retried Register gets its slot again
            if w is None:
                return pb.RegisterReply(status=pb.RegisterReply.FULL, retry_s=1.0)
            if not again:
                event = {"kind": "join", "worker": w, "name": request.name, "device": request.device}
                st.record({**event, "nonce": request.nonce})
                log(f"worker {w} joined ({request.name}, {request.device})")
            st.renew(w)
            token = st.coord.workers[w]["token"]
        return pb.RegisterReply(
            status=pb.RegisterReply.OK,
            worker=w,
            run_id=st.run_id,
            config_json=json.dumps(st.cfg.to_dict()),
            shard_tokens=st.coord.shard_sizes,
            shard_plan=st.shard_plan,
            heartbeat_s=max(0.1, st.cfg.worker_timeout_s / 4),
            token=token,
        )

    def GetJob(self, request, ctx):
        st, w = self.st, request.worker
        self._check(request.run_id, ctx)
        limit = time.monotonic() + LONG_POLL_S
        with st.cond:
            while True:
                known = st.touch(w, request.token)
                if st.coord.finished:
                    st.tell_done(request.token)
                    yield_header, job = pb.JobChunk(status=pb.JobChunk.DONE), None
                    break
                if not known:
                    yield_header, job = pb.JobChunk(status=pb.JobChunk.UNKNOWN_WORKER), None
                    break
                jid = st.coord.workers[w]["job"]
                if jid is not None and jid in st.coord.jobs:
                    job = st.coord.jobs[jid]
                    yield_header = None
                    break
                if time.monotonic() >= limit:
                    yield_header, job = pb.JobChunk(status=pb.JobChunk.WAIT, retry_s=0.0), None
                    break
                st.cond.wait(1.0)
        if job is None:
            yield yield_header
            return
        blob = st.params_blob(job)
        st.count_received(w, len(blob))
        yield pb.JobChunk(
            status=pb.JobChunk.RUN,
            job=job.job,
            steps=job.steps,
            shard=job.shard,
            lr_step=job.lr_step,
            lr_stride=job.lr_stride,
            position=job.position,
            version=job.version,
            seconds=job.seconds or 0.0,  # a deadline job's length (0: a job of `steps` steps)
            total_bytes=len(blob),
        )
        for at in range(0, len(blob), CHUNK_BYTES):
            yield pb.JobChunk(data=blob[at : at + CHUNK_BYTES])

    def Push(self, request_iterator, ctx):
        """Check a pushed outer_grad before it touches anything, then log it (durably) and
        acknowledge it. A refused push changes neither θ nor the version (see `_refuse`)."""
        st = self.st
        t0 = time.perf_counter()
        head = next(request_iterator, None)
        if head is None:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty push; send a header chunk first")
        self._check(head.run_id, ctx)
        w, jid, token = head.worker, head.job, head.token
        refuse = functools.partial(self._refuse, ctx, w, token, jid, steps=head.steps)
        limit = st.max_message_bytes
        if head.total_bytes > limit:
            refuse(
                "oversized", f"push of job {jid} announces {head.total_bytes} bytes, over the limit {limit}"
            )
        parts, size = [], 0
        for chunk in itertools.chain([head], request_iterator):
            size += len(chunk.data)
            if size > limit:
                refuse("oversized", f"push of job {jid} sent more than this run's limit of {limit} bytes")
            parts.append(chunk.data)
        blob = b"".join(parts)
        if len(blob) != head.total_bytes:
            refuse("length", f"push of job {jid} has {len(blob)} bytes, its header says {head.total_bytes}")
        with st.cond:
            st.touch(w, token)
            verdict = self._verdict(ctx, w, token, jid, head.steps)
            if verdict is not None:
                return verdict
            job = st.coord.jobs[jid]
        if head.version != job.version:
            refuse("version", f"job {jid} started from version {job.version}, the push says {head.version}")
        if job.seconds is not None and not 1 <= head.steps <= DEADLINE_CAP * job.steps:
            refuse(
                "steps",
                f"job {jid} is a deadline job of at most {DEADLINE_CAP * job.steps} inner steps, the push "
                f"says {head.steps}",
            )
        if job.seconds is None and head.steps != job.steps:
            refuse("steps", f"job {jid} has {job.steps} inner steps, the push says {head.steps}")
        if not head.finite and st.cfg.on_nonfinite == "stop":  # not logged: a resume can go past it
            with st.cond:
                st.fail(
                    NonFinite(
                        f"worker {w} produced a non-finite (NaN or Inf) training loss or outer_grad in job "
                        f"{jid}; the run stopped before applying it and its last checkpoint is intact: "
                        "--resume it if the cause was passing, or start again with a lower --inner-lr or "
                        "with --on-nonfinite drop."
                    )
                )
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "the run stopped on a non-finite outer_grad")
        try:
            message = Encoded.from_bytes(blob)
            st.side.codec.check(message)
        except UserError as e:
            refuse("malformed", str(e).removesuffix(" resend it.").rstrip(";."))
        got = [(tuple(t.shape), t.dtype) for t in message.payload]
        if got != st.expected_message or message.meta != st.expected_meta:
            refuse("shape", f"job {jid}'s outer_grad does not have this model's shapes and dtypes")
        norm = None
        if head.finite:  # an outer_grad flagged non-finite is dropped by the rule (--on-nonfinite drop)
            try:
                grads = st.side.codec.decode(message)  # e.g. topk indices out of order or range
            except UserError as e:
                refuse("malformed", str(e).removesuffix(" resend it.").rstrip(";."))
            # one fused pass: the norm is finite exactly when every value is (or it overflows)
            total = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
            if not math.isfinite(total):
                detail = f"job {jid}'s outer_grad has NaN or Inf values (or overflows) but says it is finite"
                refuse("nonfinite", detail)
            norm = total / math.sqrt(max(1, head.steps))  # the steps it took (checked above)
        with st.cond:
            verdict = self._verdict(ctx, w, token, jid, head.steps)
            if verdict is not None:
                return verdict
            c = st.coord
            if st.cfg.max_staleness and c.side.version - job.version > st.cfg.max_staleness:
                refuse(
                    "stale",
                    f"job {jid} started from version {job.version}, "
                    f"{c.side.version - job.version} updates ago "
                    f"(--max-staleness {st.cfg.max_staleness})",
                    code=grpc.StatusCode.FAILED_PRECONDITION,
                )
            bound = c.norm_bound(st.cfg.max_update_norm_ratio)
            if norm is not None and bound is not None and norm > bound:
                refuse(
                    "norm",
                    f"job {jid}'s outer_grad has norm {norm:.4g} per √step, over {bound:.4g} "
                    f"(--max-update-norm-ratio {st.cfg.max_update_norm_ratio:g} × the median of recent ones)",
                )
            event = {
                "kind": "push",
                "job": jid,
                "worker": w,
                "steps": head.steps,  # checked above: the job's, or what a deadline job took
                "loss": head.mean_loss,
                "lr": head.last_lr,
                "compute_s": head.compute_s,
                "finite": head.finite,
                "nbytes": message.nbytes,
                "norm": norm,
            }
            st.record(event, blob, message)
            st.count_sent(w, len(blob))
            st.push_took(time.perf_counter() - t0)
        return pb.PushReply(status=pb.PushReply.ACCEPTED)

    def _refuse(
        self, ctx, w: int, token: int, jid: int, reason: str, detail: str, code=None, steps: int | None = None
    ):
        """Refuse a push: a `reject` event (counted in metrics as kind "rejected"; when the job is
        the pusher's own, it is given back, as when a worker leaves: θ and the version stay as
        they are), then a gRPC error with the reason. `steps`: what the push says it took (replay
        runs a deadline job for that many, Coordinator.ran_steps)."""
        st = self.st
        with st.cond:
            job = st.coord.jobs.get(jid)
            own = job is not None and job.worker == w and st.coord.known(w, token)
            event = {"kind": "reject", "job": jid, "worker": w, "reason": reason, "detail": detail}
            st.record({**event, "abandon": own, "steps": steps})
        log(f"refused a push from worker {w} ({ctx.peer()}): {detail}")
        if code is None:
            big = reason == "oversized"
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if big else grpc.StatusCode.INVALID_ARGUMENT
        ctx.abort(code, f"{reason}: {detail}")

    def _verdict(self, ctx, w: int, token: int, jid: int, steps: int):
        """The reply to a push that is not to be checked further (None: go on). Lock held."""
        st, c = self.st, self.st.coord
        if jid in c.pushed:
            if c.pushed[jid] == w:  # a retry after a lost reply: already in
                return pb.PushReply(status=pb.PushReply.DUPLICATE, reason=f"job {jid} was accepted before")
            self._refuse(
                ctx,
                w,
                token,
                jid,
                "replay",
                f"job {jid} was pushed by worker {c.pushed[jid]} and applied",
                code=grpc.StatusCode.PERMISSION_DENIED,
            )
        if jid < 0 or jid >= c.next_job:
            self._refuse(ctx, w, token, jid, "unknown_job", f"job {jid} was never handed out")
        job = c.jobs.get(jid)
        if job is not None and job.worker != w:
            self._refuse(
                ctx,
                w,
                token,
                jid,
                "not_yours",
                f"job {jid} was given to worker {job.worker}, not worker {w}",
                code=grpc.StatusCode.PERMISSION_DENIED,
            )
        if job is None or not c.known(w, token):
            if job is None and jid not in c.late:
                st.record({"kind": "late", "job": jid, "worker": w, "steps": steps})
            return pb.PushReply(
                status=pb.PushReply.LATE, reason=f"job {jid} was abandoned (round closed or lease ran out)"
            )
        return None

    def Heartbeat(self, request, ctx):
        self._check(request.run_id, ctx)
        st = self.st
        with st.cond:
            known, done = st.touch(request.worker, request.token), st.coord.finished
            if done:  # a worker mid-job hears it here, not after its job
                st.tell_done(request.token)
                st.cond.notify_all()
            return pb.HeartbeatReply(known=known, done=done)

    def Leave(self, request, ctx):
        self._check(request.run_id, ctx)
        st = self.st
        with st.cond:
            if st.coord.known(request.worker, request.token):
                st.leave(request.worker, "left")
            st.stop_calling(request.token)
        return pb.LeaveReply()
