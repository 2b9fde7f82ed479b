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
import time

import grpc

from diloco.errors import NonFinite
from diloco.runtime.server import checks
from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server import diloco_pb2_grpc as rpc
from diloco.runtime.server.jobs import most_steps
from diloco.runtime.server.probe import ProbeHandlers
from diloco.runtime.server.state import ServerState, log
from diloco.runtime.server.wire import CHUNK_BYTES, PROTOCOL

LONG_POLL_S = 5.0  # a worker asking for a job waits this long for one before being told to ask again


class Handlers(ProbeHandlers, rpc.ParameterServerServicer):
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
        ranks, per_worker = request.ranks or 1, st.cfg.procs_per_worker
        if per_worker % ranks:
            ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this run's workers take batches of {per_worker} x --batch-size rows (diloco serve "
                f"--procs-per-worker {per_worker}), which a group of {ranks} ranks cannot split evenly; "
                f"start the worker with a number of ranks that divides {per_worker} (torchrun "
                f"--nproc-per-node {per_worker} -m diloco worker ...)",
            )
        with st.cond:
            if st.coord.finished:
                return pb.RegisterReply(status=pb.RegisterReply.DONE)
            again = [
                w for w, rec in st.coord.workers.items() if request.nonce and rec["nonce"] == request.nonce
            ]
            # torchrun restarted a group (a rank died): it takes its slot back at once, as a fresh
            # worker, instead of waiting for the old registration's lease to run out
            restarted = [
                w
                for w, rec in st.coord.workers.items()
                if request.group and rec.get("group") == request.group and not again
            ]
            if restarted:
                st.leave(restarted[0], "restarted")
            w = again[0] if again else restarted[0] if restarted else st.coord.free_slot()
            if w is None:
                return pb.RegisterReply(status=pb.RegisterReply.FULL, retry_s=1.0)
            if not again:
                event = {"kind": "join", "worker": w, "name": request.name, "device": request.device}
                group = {"ranks": ranks, "group": request.group} if ranks > 1 or request.group else {}
                st.record({**event, "nonce": request.nonce, **group})
                shown = f", {ranks} ranks" if ranks > 1 else ""
                log(f"worker {w} joined ({request.name}, {request.device}{shown})")
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
                    if job.pulled is None:  # its θ went out whole before and was let go
                        st.regive(job)
                        continue
                    yield_header, pulled = None, job.pulled
                    st.streaming.add(job.job)  # its θ is not let go while it is sent
                    durable_to = st.logged_to  # past its dispatch record (state.dispatch)
                    break
                if time.monotonic() >= limit:
                    yield_header, job = pb.JobChunk(status=pb.JobChunk.WAIT, retry_s=0.0), None
                    break
                st.cond.wait(1.0)
        if job is None:
            yield yield_header
            return
        try:
            st.make_durable(durable_to)  # the job's record, logged without waiting for it
            yield from self._send_job(st, job, pulled, request.theta, w)
        finally:
            with st.cond:
                st.streaming.discard(job.job)

    def _send_job(self, st, job, pulled, theta, w):
        """A job's header, then its θ (unless the worker has it), then θ let go (`downloaded`)."""
        st.served(job.job)
        own = st.own_theta(job, theta)  # the worker built this θ itself: not sent
        # keep: streaming, the worker goes on from its own θ
        total, pieces = (0, iter(())) if job.keep or own else st.params_stream(job, pulled)
        st.count_received(w, total)
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
            max_steps=most_steps(job),
            total_bytes=total,
            round=job.round or 0,
            keep=job.keep,
            own=own,
        )
        for piece in pieces:
            yield pb.JobChunk(data=piece)
        st.downloaded(job)

    def GetFragment(self, request, ctx):
        """Streaming DiLoCo: fragment p of a round once its outer step is taken (fragments.py)."""
        st, w, p, r = self.st, request.worker, request.fragment, request.round
        self._check(request.run_id, ctx)
        c = st.coord
        if c.schedule is None or not 0 <= p < c.schedule.fragments:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"this run has no fragment {p}")
        limit, status, tensors = time.monotonic() + LONG_POLL_S, None, None
        with st.cond:
            while status is None:
                if c.finished:  # its last merge does not matter any more
                    st.tell_done(request.token)
                    status = pb.JobChunk.DONE
                elif not st.touch(w, request.token):
                    status = pb.JobChunk.UNKNOWN_WORKER
                elif c.fragment_round[p] == r:
                    tensors = [st.side.params[i].detach().clone() for i in c.groups[p]]
                    status = pb.JobChunk.RUN
                elif c.fragment_round[p] > r or r > st.side.rounds_done + 1:
                    status = pb.JobChunk.GONE  # stepped again since: the worker joins again
                elif time.monotonic() >= limit:
                    status = pb.JobChunk.WAIT
                else:
                    st.cond.wait(1.0)
        if tensors is None:
            yield pb.JobChunk(status=status, retry_s=0.0)
            return
        blob = st.fragment_blob(r, p, tensors)
        st.count_received(w, len(blob))
        yield pb.JobChunk(status=status, round=r, total_bytes=len(blob))
        for at in range(0, len(blob), CHUNK_BYTES):
            yield pb.JobChunk(data=blob[at : at + CHUNK_BYTES])

    def Push(self, request_iterator, ctx):
        """Check a pushed outer_grad before it touches anything, then log it (durably) and
        acknowledge it. A refused push changes neither θ nor the version (see `_refuse`)."""
        st, t0 = self.st, time.perf_counter()
        head = next(request_iterator, None)
        if head is None:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty push; send a header chunk first")
        self._check(head.run_id, ctx)
        w, jid, token, p = head.worker, head.job, head.token, head.fragment - 1  # p: -1 for a whole one
        refuse = functools.partial(self._refuse, ctx, w, token, jid, steps=head.steps, fragment=p)
        if head.total_bytes > (most := st.expected(p)[2]):
            refuse(
                "oversized", f"push of job {jid} announces {head.total_bytes} bytes, over the limit {most}"
            )
        with st.push_slots.slot():  # --max-inflight-pushes: the rest wait here (slots.py)
            return self._receive(head, request_iterator, ctx, refuse, t0)

    def _receive(self, head, request_iterator, ctx, refuse, t0):
        """The rest of a push, once it has its slot: into its own file as it arrives (wal.Spool),
        which goes again unless the push is logged."""
        spool = self.st.wal.spool(f"job{head.job}")
        try:
            return self._take(head, request_iterator, ctx, refuse, t0, spool)
        finally:
            spool.discard()

    def _take(self, head, request_iterator, ctx, refuse, t0, spool):
        st, w, jid, token, p = self.st, head.worker, head.job, head.token, head.fragment - 1
        limit = st.expected(p)[2]
        for chunk in itertools.chain([head], request_iterator):
            if spool.size + len(chunk.data) > limit:
                refuse("oversized", f"push of job {jid} sent more than this run's limit of {limit} bytes")
            spool.write(chunk.data)
        if spool.size != head.total_bytes:
            refuse("length", f"push of job {jid} has {spool.size} bytes, its header says {head.total_bytes}")
        with st.cond:
            st.touch(w, token)
            verdict = self._verdict(ctx, w, token, jid, head.steps, p)
            if verdict is not None:
                return verdict
            job = st.coord.jobs[jid]
        if head.version != job.version:
            refuse("version", f"job {jid} started from version {job.version}, the push says {head.version}")
        if job.seconds is not None and not 1 <= head.steps <= most_steps(job):
            refuse(
                "steps",
                f"job {jid} is a deadline job of at most {most_steps(job)} inner steps, the push "
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
        message, norm = checks.check_push(st, spool.finish(), head, refuse)
        with st.cond:
            verdict = self._verdict(ctx, w, token, jid, head.steps, p)
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
                "norm": norm if p < 0 else None,  # the bound compares whole outer_grads
                **({"fragment": p} if p >= 0 else {}),
            }
            st.record(event, message=message, spool=spool, sync=False)
            st.count_sent(w, spool.size)
            logged_to = st.logged_to
        st.make_durable(logged_to)  # outside the lock: pushes landing together share the fdatasync
        st.push_took(time.perf_counter() - t0)
        return pb.PushReply(status=pb.PushReply.ACCEPTED)

    def _refuse(
        self,
        ctx,
        w: int,
        token: int,
        jid: int,
        reason: str,
        detail: str,
        code=None,
        steps: int | None = None,
        fragment: int = -1,
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
            more = {"fragment": fragment} if fragment >= 0 else {}  # replay: the worker stops there
            st.record({**event, "abandon": own, "steps": steps, **more})
        log(f"refused a push from worker {w} ({ctx.peer()}): {detail}")
        if code is None:
            big = reason == "oversized"
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if big else grpc.StatusCode.INVALID_ARGUMENT
        ctx.abort(code, f"{reason}: {detail}")

    def _verdict(self, ctx, w: int, token: int, jid: int, steps: int, p: int = -1):
        """The reply to a push that is not to be checked further (None: go on). Lock held.
        `p` >= 0: fragment p of a Streaming DiLoCo job."""
        st, c = self.st, self.st.coord
        streaming = c.schedule is not None
        if streaming != (p >= 0) or (streaming and p >= c.schedule.fragments):
            want = f"fragments 0 to {c.schedule.fragments - 1}" if streaming else "whole outer_grads"
            self._refuse(
                ctx, w, token, jid, "fragment", f"job {jid}'s push is fragment {p}: this run takes {want}"
            )
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
        if streaming and job is not None and c.known(w, token):
            if c.fragment_pushed(w, p):  # a retry after a lost reply: already in
                return pb.PushReply(
                    status=pb.PushReply.DUPLICATE, reason=f"fragment {p} of job {jid} came before"
                )
            if p < c.closed:  # dropped for the round; the job goes on
                return pb.PushReply(
                    status=pb.PushReply.LATE, reason=f"fragment {p} of round {job.round} closed"
                )
        if job is None or not c.known(w, token):
            if streaming:  # the job was abandoned: its worker joins again (no `late` event: it
                # stops computing that job here, as replay does)
                return pb.PushReply(status=pb.PushReply.LATE, reason=f"job {jid} was abandoned")
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
