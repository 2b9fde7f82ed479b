"""The parameter server's shared state: the coordinator (coordinator.py), its write-ahead log and
events.jsonl, and the bookkeeping around it (leases, who was told the run is over, message bytes,
refused pushes), under one lock. The main thread (service.py), the gRPC handlers (handlers.py)
and the status page (status.py) all go through a `ServerState`'s methods.

Every event goes through `record`: appended to the write-ahead log and made durable, written to
events.jsonl, then applied, all under `cond` (whose lock the caller holds), so the log's order is
the order of the state's changes. A push is acknowledged only once its record is durable.
events.jsonl is written in place (to the page cache, never synced there: a checkpoint syncs it),
so whoever hears a reply finds its events in the file; metrics lines and TensorBoard's scalars,
which cost more, are written by a thread of their own (rundir/metrics.py).

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
from diloco.runtime.server import security, slots, wal
from diloco.runtime.server.coordinator import Coordinator
from diloco.runtime.server.jobs import Job
from diloco.runtime.server.security import ServeOptions
from diloco.runtime.server.slots import PushSlots
from diloco.runtime.server.versions import Versions
from diloco.runtime.server.views import Views

MESSAGE_SLACK = 1 << 16  # a push may exceed the exact size of this model's message by this much


def log(text: str) -> None:
    print(f"diloco serve: {text}", file=sys.stderr, flush=True)


class ServerState(Views, Versions):
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
        side.after_read = wal.release_read  # a push file's pages go once the outer step read them
        self.shard_plan = shard_plan  # RUN_DIR/shards.json, sent to every worker that registers
        self.token = security.server_token(opts, run_dir)  # None: --insecure-no-token
        self.refusals = security.Refusals(log)
        # what a pushed outer_grad must look like: this model's tensors through the run's codec
        self.expected_message, self.expected_meta, self.max_message_bytes = _expected(side, side.params)
        self.push_slots = PushSlots(slots.resolve(cfg.max_inflight_pushes, self.max_message_bytes))
        # async: θ versions held for downloads at once (--max-inflight-downloads), the most held,
        # and how long jobs waited to be handed out for it
        self.downloads = {"limit": cfg.max_inflight_downloads, "most_held": 0, "waited_s": 0.0}
        self._waiting_since: float | None = None
        self.streaming: set[int] = set()  # jobs whose θ is being sent now (handlers.GetJob)
        self._recent_rejected: deque = deque(maxlen=20)  # for the status page
        self._push_seconds: deque = deque(maxlen=1000)  # receive-to-acknowledge time of recent pushes
        self.run = None  # run.loop.Run, for the metrics lines of refused pushes (attach_run)
        self.coord = Coordinator(cfg, side, shard_sizes)
        if not self.coord.sync:
            side.update.prepare(side.params)  # the rule's state now: the server at rest holds it
        # Streaming DiLoCo: each fragment's, and the fragments sent to workers (made once each)
        self._fragments = [_expected(side, [side.params[i] for i in g]) for g in self.coord.groups]
        self._fragment_blobs: dict[tuple[int, int], bytes] = {}
        self.cond = threading.Condition()
        self.run_id = uuid.uuid4().hex
        self.wal = wal.WriteAheadLog(run_dir / "wal.log")  # cuts off a torn tail left by a crash
        self._events = open(run_dir / "events.jsonl", "a")
        self.logged_to = 0  # the log's end after the last record (make_durable)
        self._last_seen: dict[int, float] = {}
        self._told_done: set[int] = set()  # registrations (tokens) told that the run is over
        self._may_call: set[int] = set()  # registrations that may still call (not left on their own)
        self._wire = [{"sent": 0, "received": 0} for _ in range(cfg.num_workers)]  # real message bytes
        self._messages: dict[int, Encoded] = {}  # version -> θ as a message, while a job needs it
        self._making = threading.Lock()  # one thread makes a version's message; the rest wait for it
        self._theta0: str | None = None  # the digest of the first version's θ as it is sent
        self._served: dict[int, float] = {}  # sync: job -> when it first went to its worker
        self._pending: deque = deque()  # the log's records after the checkpoint, to apply on resume
        self._saved_seqs = [0]  # the events the last checkpoints hold (the log keeps the rest)
        self.failure: Exception | None = None  # set by a handler: the main thread raises it
        self.t0 = time.time()  # when it started serving (after a resume's replay), for the ETA
        self._steps_at_start = 0  # inner steps done then

    # -- events --------------------------------------------------------------------------------
    def record(
        self,
        event: dict[str, Any],
        message: Encoded | None = None,
        spool: wal.Spool | None = None,
        *,
        sync: bool = True,
    ):
        """Log the event (numbered and timed), durably, then apply it; what the coordinator
        returns for it. `spool`: the pushed `message`'s file, which the record names. Lock held.

        `sync=False` (group commit) for events nobody outside hears of before a later synced
        record or `make_durable(self.logged_to)`: a push (its handler makes it durable after
        letting go of the lock, so pushes landing together share one fdatasync, then
        acknowledges it) and an apply (the next job's dispatch record, synced before the job
        goes out, or the next checkpoint, makes it durable)."""
        event = {**event, "seq": self.coord.seq + 1, "t": time.time()}
        try:
            self.logged_to = self.wal.append(event, spool=spool, sync=sync)
        except OSError as e:
            self._log_failed(e)
        return self._apply(event, message)

    def dispatch(self, event: dict[str, Any]):
        """Log a job's dispatch (`plan_dispatch`'s event) without waiting for its fdatasync: the
        main thread goes on applying, and GetJob makes the log durable up to `logged_to` (read
        under the lock, so past this record) before the job goes out, sharing one fdatasync with
        the pushes landing then. A dispatch lost in a crash was never heard of. Lock held."""
        return self.record(event, sync=False)

    def make_durable(self, end: int) -> None:
        """The log durable up to byte `end` (`logged_to` after a `record(..., sync=False)`);
        a push's handler calls it without the lock, so concurrent callers share one fdatasync."""
        try:
            self.wal.sync_to(end)
        except OSError as e:
            with self.cond:
                self._log_failed(e)

    def _log_failed(self, e: OSError) -> None:
        self.fail(
            UserError(
                f"cannot write the write-ahead log {self.wal.path} ({e.strerror}); free the disk and "
                f"continue with: diloco serve --resume {self.run_dir}"
            )
        )
        raise self.failure from None

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
                out = self._apply(header, self._logged_message(header, payload))
                if out is not None:
                    return out
        return None

    def _logged_message(self, header: dict[str, Any], payload: bytes | Path) -> Encoded | None:
        """The pushed message a logged record holds (in its push file, or in older logs inline)."""
        if isinstance(payload, bytes):
            return Encoded.from_bytes(payload) if payload else None
        if not payload.is_file() or payload.stat().st_size != header["bytes"]:
            raise UserError(
                f"the write-ahead log of {self.run_dir} names the push file {payload}, which is missing or "
                f"not {header['bytes']} bytes long (was it deleted or moved?): this run cannot be resumed "
                "exactly from its last checkpoint; put the file back or start the run again."
            )
        return Encoded.from_bytes(wal.map_file(payload))

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
        said = {
            "expired": f"was silent for {silent:.0f} s: it is gone, its job is re-offered",
            "left": "left the run (it said it stops)",
            "restarted": "was restarted by torchrun: it joins again as a fresh worker, its job is re-offered",
            "late": "missed its round's end (Streaming DiLoCo): it joins again as a fresh worker",
        }
        log(f"worker {w} ({name}) {said[reason]}")

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

    def served(self, job: int) -> None:
        """Job `job`'s header is on its way to its worker (the first time counts)."""
        with self.cond:
            self._served.setdefault(job, time.time())

    def first_served(self, jobs: list[int]) -> float | None:
        """When the first of `jobs` went to its worker (None: none did); forgets them. Lock held.
        A sync round's training part starts there: its workers' start-up is not in it."""
        times = [t for j in jobs if (t := self._served.pop(j, None)) is not None]
        return min(times) if times else None

    def push_took(self, seconds: float) -> None:
        """A push was acknowledged `seconds` after it began to arrive."""
        self._push_seconds.append(seconds)

    def regive(self, job: Job) -> None:
        """A job asked for again after its θ was let go (`downloaded`): given back; its worker
        gets a new one. Lock held."""
        self.record({"kind": "regive", "job": job.job, "worker": job.worker})
        log(f"worker {job.worker} asked again for job {job.job}, whose θ it was sent: it gets a new job")

    def expected(self, p: int) -> tuple[list, dict, int]:
        """What a push must look like (payload shapes and dtypes, codec meta, most bytes): a whole
        outer_grad (p < 0) or Streaming DiLoCo's fragment p."""
        if p < 0:
            return self.expected_message, self.expected_meta, self.max_message_bytes
        return self._fragments[p]

    def fragment_blob(self, round_: int, p: int, tensors: list[torch.Tensor]) -> bytes:
        """Fragment p of round `round_` (`tensors`: θ's, copied under the lock) as sent to workers,
        made once."""
        blob = self._fragment_blobs.get((round_, p))
        if blob is None:
            blob = self.side.download.encode(tensors).to_bytes()
            with self.cond:
                latest = self.coord.fragment_round
                self._fragment_blobs = {k: b for k, b in self._fragment_blobs.items() if latest[k[1]] == k[0]}
                self._fragment_blobs[(round_, p)] = blob
        return blob

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's "server" entry; the log keeps the events after it. Lock held."""
        self.make_durable(self.logged_to)  # no checkpoint ahead of the durable log
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


def _expected(side: OuterSide, params: list[torch.Tensor]) -> tuple[list, dict, int]:
    """A pushed message of `params`' outer_grad: its payload's shapes and dtypes, its codec meta
    (e.g. fp4's and topk's shapes), and its largest size."""
    template = side.codec.encode([torch.zeros_like(p) for p in params], {})
    shapes = [(tuple(t.shape), t.dtype) for t in template.payload]
    return shapes, template.meta, len(template.to_bytes()) + MESSAGE_SLACK
