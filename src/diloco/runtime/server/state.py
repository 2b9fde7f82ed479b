"""The parameter server's shared state: the coordinator (coordinator.py), its write-ahead log and
events.jsonl, and the bookkeeping around it (leases, who was told the run is over, message bytes,
refused pushes), under one lock. The main thread (service.py), the gRPC handlers (handlers.py)
and the status page (status.py) all go through a `ServerState`'s methods.

Every event goes through `record`: appended to the write-ahead log and made durable, written to
events.jsonl, then applied, all under `cond` (whose lock the caller holds), so the log's order is
the order of the state's changes. A push is acknowledged only once its record is durable.

    state = ServerState(cfg, side, shard_sizes, run_dir, ServeOptions())
    with state.cond:
        state.record({"kind": "join", "worker": 0, "name": "host", "device": "cpu", "nonce": ""})
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import torch

from diloco.config import TrainConfig
from diloco.core.codec import Encoded
from diloco.core.outer_side import OuterSide
from diloco.errors import UserError
from diloco.runtime.server import security, wal
from diloco.runtime.server.coordinator import Coordinator
from diloco.runtime.server.jobs import Job
from diloco.runtime.server.security import ServeOptions

MESSAGE_SLACK = 1 << 16  # a push may exceed the exact size of this model's message by this much


def log(text: str) -> None:
    print(f"diloco serve: {text}", file=sys.stderr, flush=True)


class ServerState:
    """What the server's threads share (see the module docstring). Methods marked "lock held"
    expect the caller to hold `cond`; the others take it themselves or need no lock."""

    def __init__(
        self,
        cfg: TrainConfig,
        side: OuterSide,
        shard_sizes: list[int],
        run_dir: Path,
        opts: ServeOptions,
        shard_plan: str = "",
    ):
        self.cfg, self.side, self.run_dir, self.opts = cfg, side, run_dir, opts
        self.shard_plan = shard_plan  # RUN_DIR/shards.json, sent to every worker that registers
        self.token = security.server_token(opts, run_dir)  # None: --insecure-no-token
        self.refusals = security.Refusals(log)
        # what a pushed outer_grad must look like: this model's tensors through the run's codec
        template = side.codec.encode([torch.zeros_like(p) for p in side.params], {})
        self.expected_message = [(tuple(t.shape), t.dtype) for t in template.payload]
        self.expected_meta = template.meta  # e.g. fp4's and topk's shapes
        self.max_message_bytes = len(template.to_bytes()) + MESSAGE_SLACK
        self._recent_rejected: deque = deque(maxlen=20)  # for the status page
        self._push_seconds: deque = deque(maxlen=1000)  # receive-to-acknowledge time of recent pushes
        self.run = None  # run.loop.Run, for the metrics lines of refused pushes (attach_run)
        self.coord = Coordinator(cfg, side, shard_sizes)
        self.cond = threading.Condition()
        self.run_id = uuid.uuid4().hex
        self.wal = wal.WriteAheadLog(run_dir / "wal.log")  # cuts off a torn tail left by a crash
        self._events = open(run_dir / "events.jsonl", "a")
        self._last_seen: dict[int, float] = {}
        self._told_done: set[int] = set()  # registrations (tokens) told that the run is over
        self._may_call: set[int] = set()  # registrations that may still call (not left on their own)
        self._wire = [{"sent": 0, "received": 0} for _ in range(cfg.num_workers)]  # real message bytes
        self._blobs: dict[int, bytes] = {}  # version -> θ as a message, while a job needs it
        self._pending: deque = deque()  # the log's records after the checkpoint, to apply on resume
        self._saved_seqs = [0]  # the events the last checkpoints hold (the log keeps the rest)
        self.failure: Exception | None = None  # set by a handler: the main thread raises it
        self.t0 = time.time()  # when it started serving (after a resume's replay), for the ETA
        self._steps_at_start = 0  # inner steps done then

    # -- events --------------------------------------------------------------------------------
    def record(self, event: dict[str, Any], payload: bytes = b"", message: Encoded | None = None):
        """Log the event durably (numbered and timed), then apply it; what the coordinator
        returns for it. Lock held."""
        event = {**event, "seq": self.coord.seq + 1, "t": time.time()}
        try:
            self.wal.append(event, payload)  # durable before anyone acts on it
        except OSError as e:
            self.fail(
                UserError(
                    f"cannot write the write-ahead log {self.wal.path} ({e.strerror}); free the disk and "
                    f"continue with: diloco serve --resume {self.run_dir}"
                )
            )
            raise self.failure from None
        return self._apply(event, message)

    def _apply(self, event: dict[str, Any], message: Encoded | None):
        """A logged event: into events.jsonl, then applied to the state."""
        self._events.write(json.dumps(event) + "\n")
        self._events.flush()
        out = self.coord.apply(event, message)
        if event["kind"] == "join":
            self._may_call.add(event["seq"])
        if event["kind"] == "reject":
            self._rejected(event)
        self.cond.notify_all()
        return out

    def _rejected(self, e: dict[str, Any]) -> None:
        fields = {k: e[k] for k in ("reason", "worker", "job", "detail")}
        self._recent_rejected.append({"t": e["t"], **fields})
        if self.run is not None:
            c = self.coord
            step = c.applied // self.cfg.num_workers if not c.sync else self.side.inner_step
            self.run.writer.log("rejected", **self.run.clock(step), **fields)

    def attach_run(self, run) -> None:
        """The run whose metrics.jsonl gets a `rejected` line for every refused push."""
        self.run = run

    @property
    def replaying(self) -> bool:
        """Whether records of the write-ahead log after the checkpoint are still to apply."""
        return bool(self._pending)

    def replay_next(self):
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

    def sync_events(self) -> int:
        """events.jsonl flushed to disk; its length. Lock held."""
        self._events.flush()
        os.fsync(self._events.fileno())
        return self._events.tell()

    # -- failures ------------------------------------------------------------------------------
    def fail(self, error: Exception) -> None:
        """Stop the run: the main thread raises `error` at its next look. Lock held."""
        self.failure = error
        self.cond.notify_all()

    def raise_failure(self) -> None:
        """Raise the failure a handler set, if any."""
        if self.failure is not None:
            raise self.failure

    # -- leases and membership (lock held) -----------------------------------------------------
    def renew(self, w: int) -> None:
        """Worker w was heard from: its lease starts again."""
        self._last_seen[w] = time.monotonic()

    def touch(self, w: int, token: int) -> bool:
        """Renew worker w's lease if it is the registration that got `token`; whether it is."""
        known = self.coord.known(w, token)
        if known:
            self.renew(w)
        return known

    def reap(self) -> None:
        """Workers not heard from for --worker-timeout-s are gone: their jobs are abandoned."""
        now = time.monotonic()
        for w in list(self.coord.workers):
            seen = self._last_seen.setdefault(w, now)
            if now - seen > self.cfg.worker_timeout_s:
                self.leave(w, "expired")

    def leave(self, w: int, reason: str) -> None:
        """Worker w is gone: it said it stops ("left"), or its lease ran out ("expired")."""
        name = self.coord.workers[w]["name"]
        silent = time.monotonic() - self._last_seen.get(w, time.monotonic())
        self.record({"kind": "leave", "worker": w, "reason": reason})
        self._last_seen.pop(w, None)
        gone = f"was silent for {silent:.0f} s: it is gone, its job is re-offered"
        log(f"worker {w} ({name}) " + (gone if reason == "expired" else "left the run (it said it stops)"))

    def tell_done(self, token: int) -> None:
        """The registration that got `token` has heard that the run is over."""
        self._told_done.add(token)

    def stop_calling(self, token: int) -> None:
        """The registration that got `token` left on its own: it will not call again."""
        self._may_call.discard(token)

    def untold(self) -> set[int]:
        """Registrations that may still call and have not heard that the run is over."""
        return self._may_call - self._told_done

    def begin_serving(self) -> None:
        """The server starts answering: every registered worker gets a lease (a resumed server's
        too), and the ETA counts from now."""
        self.t0, self._steps_at_start = time.time(), sum(t["steps"] for t in self.coord.totals)
        now = time.monotonic()
        self._last_seen = {w: now for w in self.coord.workers}  # a resumed server gives them a lease
        self._may_call |= {rec["token"] for rec in self.coord.workers.values()}

    # -- traffic -------------------------------------------------------------------------------
    def count_sent(self, w: int, nbytes: int) -> None:
        """Worker w pushed a message of `nbytes`."""
        self._wire[w]["sent"] += nbytes

    def count_received(self, w: int, nbytes: int) -> None:
        """Worker w pulled a message of `nbytes`."""
        self._wire[w]["received"] += nbytes

    def push_took(self, seconds: float) -> None:
        """A push was acknowledged `seconds` after it began to arrive."""
        self._push_seconds.append(seconds)

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

    # -- views ---------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """summary.json's per-worker rows and the events count. Lock held."""
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
                    "wire_bytes_sent": self._wire[w]["sent"],
                    "wire_bytes_received": self._wire[w]["received"],
                }
            )
        return {"workers": rows, "events": c.seq}

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
                seen = self._last_seen.get(w)
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
                        "bytes_sent": self._wire[w]["sent"],
                        "bytes_received": self._wire[w]["received"],
                        "last_seen_s": None if seen is None else round(mono - seen, 1),
                    }
                )
            return {
                "run_dir": str(self.run_dir),
                "run_id": self.run_id,
                "method": self.cfg.method,
                "rule": self.cfg.async_.rule if not c.sync else self.cfg.outer.opt,
                "k": self.cfg.num_workers,
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
                "recent_rejected": list(self._recent_rejected),
                "unauthenticated": self.refusals.count,
                "push_seconds": sorted(self._push_seconds),
            }

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's "server" entry; the log keeps the events after it. Lock held."""
        self._saved_seqs = [*self._saved_seqs[-1:], self.coord.seq]
        offset = self.sync_events()
        return {
            "coordinator": self.coord.state_dict(),
            "run_id": self.run_id,
            "events_offset": offset,
            "wire": [dict(x) for x in self._wire],
        }

    def after_checkpoint(self) -> None:
        """Drop the log's records that the checkpoint before this one holds (not this one's: if
        it turns out corrupt, --resume falls back to the one before, and needs its records)."""
        with self.cond:
            self.wal.truncate(self._saved_seqs[0])

    def load_state_dict(self, s: dict[str, Any]) -> None:
        """Restore the checkpoint's "server" entry (`state_dict`) and read the write-ahead log's
        later records, which `replay_next` applies."""
        self.coord.load_state_dict(s["coordinator"])
        self.run_id, self._wire = s["run_id"], [dict(x) for x in s["wire"]]
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

    def close(self) -> None:
        """Close the write-ahead log and events.jsonl."""
        self.wal.close()
        self._events.close()
