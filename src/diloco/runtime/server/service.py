"""The parameter server runtime: the coordinator (coordinator.py) behind a gRPC service, on the
real clock, with a write-ahead log.

`ServerRuntime` has the runtime interface of runtime/__init__.py, so `diloco serve` is `diloco
train`'s loop (evaluation, metrics, checkpoints, summary) with this runtime: its main thread
decides (rounds, jobs, grace windows, leases) and applies outer steps; gRPC threads answer the
workers (handlers.py). Every event goes through `_record`: appended to the write-ahead log and made durable,
written to events.jsonl, then applied, all under one lock, so the log's order is the order of
the state's changes. A push is acknowledged only once its record is durable.

    diloco serve --out runs/srv --port 7000      # then: diloco worker --server localhost:7000
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

from diloco import rundir
from diloco.config import TrainConfig
from diloco.core.codec import Encoded
from diloco.core.outer_side import OuterSide
from diloco.errors import UserError
from diloco.rundir import checkpoint
from diloco.runtime import SideView
from diloco.runtime.server import diloco_pb2_grpc as rpc
from diloco.runtime.server import security, wal
from diloco.runtime.server.coordinator import Coordinator, Job
from diloco.runtime.server.handlers import CHUNK_BYTES, Handlers, log
from diloco.runtime.server.security import ServeOptions

TICK_S = 0.2  # how often the main thread looks at leases and deadlines while it waits
MESSAGE_SLACK = 1 << 16  # a push may exceed the exact size of this model's message by this much
NOTE_S = 30.0  # a wait says why after this long, then after twice as long each time it goes on
SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of a network interface


class ServerRuntime(SideView):
    """The server's side of a run (see the module docstring). `listen` is HOST:PORT (port 0:
    any free port; the address is written to RUN_DIR/server.json)."""

    is_main = True
    sim_time_s = None

    def __init__(
        self,
        cfg: TrainConfig,
        side: OuterSide,
        shard_sizes: list[int],
        run_dir: Path,
        opts: ServeOptions | None,
        shard_plan: str = "",
    ):
        opts = opts or ServeOptions()
        self.cfg, self.side, self.run_dir, self.opts = cfg, side, run_dir, opts
        self._lock = rundir.lock(run_dir)  # one server per run directory, before anything is written
        self._fresh = not (run_dir / "checkpoints").exists()  # a new run, not a resumed one
        self._discard = False  # a new run that could not start serving leaves no run directory
        self.shard_plan = shard_plan  # RUN_DIR/shards.json, sent to every worker that registers
        self.listen = opts.listen
        self.token = security.server_token(opts, run_dir)  # None: --insecure-no-token
        self.refusals = security.Refusals(log)
        # what a pushed outer_grad must look like: this model's tensors through the run's codec
        template = side.codec.encode([torch.zeros_like(p) for p in side.params], {})
        self.expected_message = [(tuple(t.shape), t.dtype) for t in template.payload]
        self.expected_meta = template.meta  # e.g. fp4's and topk's shapes
        self.max_message_bytes = len(template.to_bytes()) + MESSAGE_SLACK
        self.recent_rejected: deque = deque(maxlen=20)  # for the status page
        self.push_seconds: deque = deque(maxlen=1000)  # receive-to-acknowledge time of recent pushes
        self.run = None  # train.Run, for the metrics lines of refused pushes (attach_run)
        self.status_page = None
        self.coord = Coordinator(cfg, side, shard_sizes)
        self.cond = threading.Condition()
        self.run_id = uuid.uuid4().hex
        self.wal = wal.WriteAheadLog(run_dir / "wal.log")  # cuts off a torn tail left by a crash
        self._events = open(run_dir / "events.jsonl", "a")
        self.last_seen: dict[int, float] = {}
        self.told_done: set[int] = set()  # registrations (tokens) told that the run is over
        self.may_call: set[int] = set()  # registrations that may still call (not left on their own)
        self.wire = [{"sent": 0, "received": 0} for _ in range(cfg.num_workers)]  # real message bytes
        self._blobs: dict[int, bytes] = {}  # version -> θ as a message, while a job needs it
        self._pending: deque = deque()  # the log's records after the checkpoint, to apply on resume
        self._group: list[int] = []  # async: jobs of the grace group still to apply
        self._saved_seqs = [0]  # the events the last checkpoints hold (the log keeps the rest)
        self.failure: Exception | None = None  # set by a handler: the main thread raises it
        self._server: grpc.Server | None = None
        self.address: str | None = None
        self.t0 = time.time()  # when it started serving (after a resume's replay), for the ETA
        self._steps_at_start = 0  # inner steps done then

    # -- the runtime interface -----------------------------------------------------------------
    num_workers = property(lambda self: self.cfg.num_workers)
    step_budget = property(lambda self: self.coord.step_budget)
    applied = property(lambda self: self.coord.applied)
    done = property(lambda self: self.coord.finished and not self._pending)
    at_boundary = property(lambda self: not self._group)

    def broadcast(self, obj: Any) -> Any:
        return obj

    def round(self, *, active: int | None = None):
        """One sync round: every registered worker (all k for the first round) gets a job; the
        round closes when each has pushed or left, or when --round-timeout-s passes."""
        if (replayed := self._drainlog()) is not None:
            return replayed
        self._start()
        c = self.coord
        with self.cond:
            if not c.members:  # else the round the server was in when it stopped goes on
                need = self.num_workers if self.side.rounds_done == 0 else 1
                self._wait(
                    lambda: len(c.workers) >= need, lambda: f"{len(c.workers)} of {need} workers registered"
                )
                members = sorted(c.workers)
                self._record({"kind": "begin", "round": self.side.rounds_done + 1, "members": members})
                for w in members:
                    self._record(c.plan_dispatch(w))
            t0 = c.round_t
            timeout = self.cfg.round_timeout_s or float("inf")
            self._wait(lambda: not c.jobs or time.time() >= t0 + timeout, lambda: f"{len(c.jobs)} pushes")
            computes = [push["compute_s"] for push, _ in c.inbox.values()]
            stats = self._record({"kind": "close", "round": self.side.rounds_done + 1})
        wall_s = time.time() - t0
        compute_s = sum(computes) / len(computes) if computes else 0.0
        stats.timing = {"compute_s": compute_s, "comm_s": max(0.0, wall_s - compute_s)}
        return stats

    def step(self):
        """Async: apply the next arrived outer_grad (with a grace period, the pushes that land
        before the window closes form a group, applied one per call, whose workers then restart
        together); hands out jobs to idle workers. None when the budget is spent."""
        if (replayed := self._drainlog()) is not None:
            return replayed
        self._start()
        c = self.coord
        with self.cond:
            while True:
                if self._group:
                    return self._record({"kind": "apply", "job": self._group.pop(0)})
                if c.finished:
                    return None
                self._reap()
                for w in c.idle():
                    event = c.plan_dispatch(w)
                    if event is None:
                        break
                    self._record(event)
                if c.arrived:
                    self._group = self._grace_group()
                elif c.dispatched == c.step_budget and not c.jobs:
                    self._record({"kind": "flush"})
                    return None
                else:
                    self._wait_once()
                    if not c.workers and not c.jobs:
                        self._note(lambda: "no worker registered")

    def _grace_group(self) -> list[int]:
        """Wait for the pushes expected within the grace period (all in flight whose speed is not
        known yet, or due before it ends), at most until it ends; the arrived pushes are the group."""
        c = self.coord
        grace = c.grace_s()
        if grace > 0:
            end = c.arrived[0][0]["t"] + grace

            def expected() -> list[Job]:
                return [j for j in c.jobs.values() if (due := c.due(j)) is None or due <= end]

            self._wait(lambda: not expected() or time.time() >= end, lambda: "the grace period")
        return [push["job"] for push, _, _ in c.arrived]

    def summary_extras(self) -> dict[str, Any]:
        with self.cond:
            return self._summary_extras()

    def _summary_extras(self) -> dict[str, Any]:
        now, c = time.time(), self.coord
        rows = []
        for w, tot in enumerate(c.totals):
            present_s = tot["present_s"] + (now - c.workers[w]["joined_t"] if w in c.workers else 0.0)
            compute_s, present_s = round(tot["compute_s"], 3), round(present_s, 3)
            rows.append(
                {
                    "worker": w,
                    "jobs": tot["jobs"],
                    "inner_steps": self.side.worker_steps[w],  # as summary.json's inner_steps_per_worker
                    "compute_s": compute_s,
                    "present_s": present_s,  # registered
                    "compute_utilisation": round(compute_s / present_s, 4) if present_s > 0 else None,
                    "mean_staleness": tot["staleness"] / tot["jobs"] if tot["jobs"] and not c.sync else None,
                    "step_s": c.workers[w]["step_s"] if w in c.workers else tot["step_s"],
                    "wire_bytes_sent": self.wire[w]["sent"],
                    "wire_bytes_received": self.wire[w]["received"],
                }
            )
        return {"workers": rows, "events": c.seq, "server_address": self.address}

    def status(self) -> dict[str, Any]:
        """The run at a glance, for the status page (`/status`, `/`, `/metrics`)."""
        with self.cond:
            c, now, mono = self.coord, time.time(), time.monotonic()
            done = sum(t["steps"] for t in c.totals)
            elapsed = now - self.t0
            rate = (done - self._steps_at_start) / elapsed if elapsed > 0 else 0.0
            workers = []
            for w, tot in enumerate(c.totals):
                rec = c.workers.get(w)
                if rec is None and not tot["jobs"]:
                    continue
                job = c.jobs.get(rec["job"]) if rec and rec["job"] is not None else None
                waiting = any(j.worker == w for _, _, j in c.arrived) or (c.sync and w in c.inbox)
                state = "gone" if rec is None else "working" if job else "pushed" if waiting else "idle"
                seen = self.last_seen.get(w)
                workers.append(
                    {
                        "worker": w,
                        "host": rec["name"] if rec else None,
                        "device": rec["device"] if rec else None,
                        "state": state,
                        "step_s": rec["step_s"] if rec else tot["step_s"],
                        "steps": job.steps if job else tot.get("last_steps"),
                        "staleness": tot.get("last_staleness"),
                        "jobs": tot["jobs"],
                        "inner_steps": tot["steps"],
                        "bytes_sent": self.wire[w]["sent"],
                        "bytes_received": self.wire[w]["received"],
                        "last_seen_s": None if seen is None else round(mono - seen, 1),
                    }
                )
            return {
                "run_dir": str(self.run_dir),
                "run_id": self.run_id,
                "method": self.cfg.method,
                "rule": self.cfg.async_.rule if not c.sync else self.cfg.outer.opt,
                "k": self.num_workers,
                "H": self.cfg.inner_steps,
                "version": self.side.version,
                "inner_steps": done,
                "inner_step_budget": c.step_budget,
                "eta_s": round((c.step_budget - done) / rate, 1) if rate > 0 and not c.finished else None,
                "elapsed_s": round(elapsed, 1),
                "finished": c.finished,
                "tls": self.opts.tls_cert is not None,
                "auth": self.token is not None,
                "workers": workers,
                "rejected": dict(c.rejected),
                "recent_rejected": list(self.recent_rejected),
                "unauthenticated": self.refusals.count,
                "push_seconds": sorted(self.push_seconds),
            }

    def state_dict(self) -> dict[str, Any]:
        with self.cond:
            self._saved_seqs = [*self._saved_seqs[-1:], self.coord.seq]
            self._events.flush()
            os.fsync(self._events.fileno())
            server = {
                "coordinator": self.coord.state_dict(),
                "run_id": self.run_id,
                "events_offset": self._events.tell(),
                "wire": [dict(x) for x in self.wire],
            }
            return {"outer": self.side.state_dict(), "workers": [], "runtime": {"server": server}}

    def after_checkpoint(self) -> None:
        """Drop the log's records that the checkpoint before this one holds (not this one's: if
        it turns out corrupt, --resume falls back to the one before, and needs its records)."""
        with self.cond:
            self.wal.truncate(self._saved_seqs[0])

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore the checkpoint, then replay the write-ahead log's later events: the state is
        what it was when the server stopped, with every acknowledged push in it."""
        if state is None:
            return
        s = state.get("runtime", {}).get("server")
        if s is None:
            raise UserError("this checkpoint is not a server run's; continue it with diloco train --resume.")
        self.side.load_state_dict(state["outer"])
        self.coord.load_state_dict(s["coordinator"])
        self.run_id, self.wire = s["run_id"], [dict(x) for x in s["wire"]]
        self._events.close()
        with open(self.run_dir / "events.jsonl", "r+b") as f:
            f.truncate(s["events_offset"])
        self._events = open(self.run_dir / "events.jsonl", "a")
        seq = self.coord.seq
        self._saved_seqs = [seq]
        self._pending = deque((h, p) for h, p in wal.read(self.wal.path) if h["seq"] > seq)
        if self._pending and self._pending[0][0]["seq"] != seq + 1:
            raise UserError(
                f"the write-ahead log of {self.run_dir} goes on from event {self._pending[0][0]['seq']}, but "
                f"the checkpoint it resumes from ends at event {seq} (the newer checkpoints are corrupt): "
                "the events in between are lost, so this run cannot be resumed exactly; start it again."
            )
        if self._pending:
            log(f"replaying {len(self._pending)} events of the write-ahead log after the checkpoint")

    def close(self, *, clean: bool = True) -> None:
        if self._server is not None:
            if clean:  # let every worker hear that the run is over, stragglers too (a late
                # push, a lease that ran out): each asks for a job every few seconds
                limit = time.monotonic() + min(10.0, self.cfg.worker_timeout_s)
                with self.cond:
                    while time.monotonic() < limit and self.may_call - self.told_done:
                        self.cond.wait(0.1)
            self._server.stop(grace=1.0).wait()
        if self.status_page is not None:
            self.status_page.close()
        self.wal.close()
        self._events.close()
        self._lock.close()
        if self._discard:  # a new run whose port was taken: a retry with the same --out must work
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- the main thread's helpers (called with the lock held) ---------------------------------
    def _record(self, event: dict[str, Any], payload: bytes = b"", message: Encoded | None = None):
        event = {**event, "seq": self.coord.seq + 1, "t": time.time()}
        try:
            self.wal.append(event, payload)  # durable before anyone acts on it
        except OSError as e:
            self.failure = UserError(
                f"cannot write the write-ahead log {self.wal.path} ({e.strerror}); free the disk and "
                f"continue with: diloco serve --resume {self.run_dir}"
            )
            self.cond.notify_all()
            raise self.failure from None
        return self._apply(event, message)

    def _apply(self, event: dict[str, Any], message: Encoded | None):
        """A logged event: into events.jsonl, then applied to the state."""
        self._events.write(json.dumps(event) + "\n")
        self._events.flush()
        out = self.coord.apply(event, message)
        if event["kind"] == "join":
            self.may_call.add(event["seq"])
        if event["kind"] == "reject":
            self._rejected(event)
        self.cond.notify_all()
        return out

    def attach_run(self, run) -> None:
        """The run whose metrics.jsonl gets a `rejected` line for every refused push."""
        self.run = run

    def _rejected(self, e: dict[str, Any]) -> None:
        fields = {k: e[k] for k in ("reason", "worker", "job", "detail")}
        self.recent_rejected.append({"t": e["t"], **fields})
        if self.run is not None:
            c = self.coord
            step = c.applied // self.num_workers if not c.sync else self.side.inner_step
            self.run.writer.log("rejected", **self.run.clock(step), **fields)

    def _reap(self) -> None:
        """Workers not heard from for --worker-timeout-s are gone: their jobs are abandoned."""
        now = time.monotonic()
        for w in list(self.coord.workers):
            seen = self.last_seen.setdefault(w, now)
            if now - seen > self.cfg.worker_timeout_s:
                self._leave(w, "expired")

    def _leave(self, w: int, reason: str) -> None:
        """Worker w is gone: it said it stops ("left"), or its lease ran out ("expired")."""
        name = self.coord.workers[w]["name"]
        silent = time.monotonic() - self.last_seen.get(w, time.monotonic())
        self._record({"kind": "leave", "worker": w, "reason": reason})
        self.last_seen.pop(w, None)
        gone = f"was silent for {silent:.0f} s: it is gone, its job is re-offered"
        log(f"worker {w} ({name}) " + (gone if reason == "expired" else "left the run (it said it stops)"))

    def _wait_once(self) -> None:
        if self.failure is not None:
            raise self.failure
        self.cond.wait(TICK_S)
        if self.failure is not None:
            raise self.failure

    def _drainlog(self):
        """On resume: apply the log's records after the checkpoint, up to the next one that closes
        a round or applies an outer_grad (returned, so its metrics are written as they were
        live); None once the log is through."""
        with self.cond:
            while self._pending:
                header, payload = self._pending.popleft()
                out = self._apply(header, Encoded.from_bytes(payload) if payload else None)
                if out is not None:
                    return out
        return None

    def _wait(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        while True:
            self._reap()
            if ready():
                return
            self._wait_once()
            self._note(lambda: f"waiting for {what()}")

    def _note(self, text: Callable[[], str]) -> None:
        """Called every tick of a wait: a stuck run says why on stderr once it has waited NOTE_S,
        and again after twice as long each time the same wait goes on (30 s, 60 s, 2 min, ...)."""
        now, line = time.time(), text()
        last = getattr(self, "_noting", None)  # (line, last call, last said or begun, gap)
        if last is None or last[0] != line or now - last[1] > 1.0:  # another wait begins
            self._noting = (line, now, now, NOTE_S)
        elif now - last[2] >= last[3]:
            log(line)
            self._noting = (line, now, now, 2 * last[3])
        else:
            self._noting = (line, now, last[2], last[3])

    def _start(self) -> None:
        if self._server is not None:
            return
        self._discard = self._fresh  # until it serves: see close()
        self.t0, self._steps_at_start = time.time(), sum(t["steps"] for t in self.coord.totals)
        now = time.monotonic()
        self.last_seen = {w: now for w in self.coord.workers}  # a resumed server gives them a lease
        self.may_call |= {rec["token"] for rec in self.coord.workers.values()}
        opts = self.opts
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4 * self.num_workers + 8),
            interceptors=[security.AuthInterceptor(self.token, self.refusals)] if self.token else [],
            options=[("grpc.max_receive_message_length", 4 * CHUNK_BYTES), ("grpc.so_reuseport", 0)],
        )
        rpc.add_ParameterServerServicer_to_server(Handlers(self), server)
        host, _, port = self.listen.rpartition(":")
        tls = opts.tls_cert is not None
        credentials = security.server_credentials(opts.tls_cert, opts.tls_key) if tls else None
        try:
            if tls:
                bound = server.add_secure_port(self.listen, credentials)
            else:
                bound = server.add_insecure_port(self.listen)
        except RuntimeError:
            bound = 0
        if not bound:
            raise UserError(
                f"cannot listen on {self.listen} (in use, or not this machine's address); "
                "choose another --port."
            )
        server.start()
        self._server, self.address = server, f"{host}:{bound}"
        if opts.http_port != -1:
            from diloco.runtime.server.status import StatusPage

            want = (bound + 1 if int(port) else 0) if opts.http_port is None else opts.http_port
            self.status_page = StatusPage(self, host, want)
        http_port = int(self.status_page.url.rsplit(":", 1)[1]) if self.status_page else -1
        token = self._token_source()
        info = {
            "address": self.address,
            "run_id": self.run_id,
            "pid": os.getpid(),
            "http": self.status_page.url if self.status_page else None,
            "tls": tls,
            # what --resume keeps: where and how it served (paths of the secrets, never their contents)
            "serve": {
                "host": host,
                "port": bound,
                "http_port": http_port,
                "tls_cert": str(opts.tls_cert.resolve()) if tls else None,
                "tls_key": str(opts.tls_key.resolve()) if tls else None,
                "token": token,
                "token_file": str(opts.token_file.resolve()) if token == "file" else None,
            },
        }
        checkpoint.atomic_write_json(self.run_dir / "server.json", info, indent=None)  # --resume reads it
        rundir.say_holder(self._lock, f"pid {os.getpid()}, serving on {self.address}")
        self._discard = False
        shown = reachable_hosts() if host in ("0.0.0.0", "::", "[::]", "") else [host]
        flags = (" --tls-ca CA.pem" if tls else "") + (" --token-file TOKEN_FILE" if self.token else "")
        also = f" (this machine is also {', '.join(shown[1:])})" if len(shown) > 1 else ""
        log(
            f"serving {self.run_dir} on {self.address}; "
            f"start workers with: diloco worker --server {shown[0]}:{bound}{flags}{also}"
        )
        if self.token is None:
            log(
                "WARNING: --insecure-no-token: anyone who can reach this port can join the run and push "
                "updates; use it on loopback only"
            )
        elif token == "generated":
            log(f"the workers' token is in {self.run_dir / 'token'} (give it to them with --token-file)")
        if self.status_page:
            query = f"?token={self.token}" if self.token else ""
            log(f"status page: {'https' if tls else 'http'}://{shown[0]}:{http_port}/{query}")

    def _token_source(self) -> str:
        """Where the run's token came from, for --resume: file, env, generated (RUN_DIR/token), none."""
        given = self.opts.token_file
        if self.token is None:
            return "none"
        if given is not None:
            return "generated" if given.resolve() == (self.run_dir / "token").resolve() else "file"
        return "env" if os.environ.get(security.ENV) else "generated"

    def params_blob(self, job: Job) -> bytes:
        """θ of job's version as a message (made once per version)."""
        with self.cond:
            blob = self._blobs.get(job.version)
        if blob is None:
            blob = self.side.download.encode(job.pulled).to_bytes()  # bf16: exactly what was made
            with self.cond:
                live = {j.version for j in self.coord.jobs.values()}
                self._blobs = {v: b for v, b in self._blobs.items() if v in live}
                self._blobs[job.version] = blob
        return blob


def reachable_hosts() -> list[str]:
    """The addresses other machines may reach this one at, for a server listening on every
    interface: each network interface's IPv4 address but loopback's, then the host name."""
    found = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                ifreq = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
        address = socket.inet_ntoa(ifreq[20:24])
        if not address.startswith("127.") and address not in found:
            found.append(address)
    return [*found, socket.gethostname()]
