"""The server worker's link to the server: the gRPC channel (TLS with --tls-ca), the token every
call carries, the retry policy of every call (a server that is down or restarting is waited for,
for --retry-s seconds), and the heartbeat that keeps the worker's lease.

    diloco worker --server localhost:7000 --retry-s 120
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc

from diloco.errors import UserError
from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server import diloco_pb2_grpc as rpc
from diloco.runtime.server import security
from diloco.runtime.server.wire import CHUNK_BYTES, PROBE_MAX_BYTES

T = TypeVar("T")
# the server is down, restarting or overloaded: wait and try again (for --retry-s seconds)
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
)


def log(text: str) -> None:
    print(f"diloco worker: {text}", file=sys.stderr, flush=True)


# a push the server refused (its reason in the message): the worker drops that job and goes on
REFUSED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


class Refused(UserError):
    """The server refused a call for a reason that retrying does not fix."""


class RunOver(Exception):
    """The heartbeat heard that the run is over: the job in hand is dropped (the server may
    already be gone, so nothing is pushed or retried)."""


# gRPC reconnects on its own schedule, under the retries of Link.call: by default 1 s growing by
# 1.6x to 2 minutes apart, which found a server back after 16–20 s down only 5–12 s later and may
# miss one within --retry-s. So it tries as documented, 0.1 s growing to 2 s apart, giving one
# attempt (TCP and TLS handshakes) up to 5 s.
OPTIONS = [
    ("grpc.max_receive_message_length", 4 * CHUNK_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.min_reconnect_backoff_ms", 5000),  # gRPC's name for the time one attempt may take
]


class Link:
    """The channel to the server (TLS with `tls_ca`), the token every call carries, and the
    retry policy of every call."""

    def __init__(self, server: str, retry_s: float, token: str | None = None, tls_ca: Path | None = None):
        self.server, self.retry_s, self.tls_ca, self.token = server, retry_s, tls_ca, token
        if tls_ca is not None:
            self.channel = grpc.secure_channel(server, security.channel_credentials(tls_ca), options=OPTIONS)
        else:
            self.channel = grpc.insecure_channel(server, options=OPTIONS)
        self.ready = threading.Event()  # the channel is connected
        self.channel.subscribe(self._state)
        self.stub = rpc.ParameterServerStub(self.channel)
        self.meta = ((security.HEADER, f"Bearer {token}"),) if token else ()

    def _state(self, state: grpc.ChannelConnectivity) -> None:
        if state == grpc.ChannelConnectivity.READY:
            self.ready.set()
        else:
            self.ready.clear()

    def _pause(self, seconds: float) -> None:
        """Wait `seconds` before the next try, or less: until a lost connection is back."""
        if self.ready.is_set():  # connected, and yet the call failed: wait it out
            time.sleep(seconds)
        else:
            self.ready.wait(seconds)

    def call(self, what: str, fn: Callable[[], T], over: threading.Event | None = None) -> T:
        """fn() until it succeeds; while the server is unreachable, retry with backoff (0.1 s up
        to 2 s) for --retry-s seconds, then a UserError. A refusal is a UserError at once. With
        `over` set (the run is over) it stops retrying: RunOver."""
        start, delay, warned = 0.0, 0.1, False  # start: when the first try failed
        while True:
            if over is not None and over.is_set():
                raise RunOver
            try:
                result = fn()
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                if (error := self._hopeless(what, code, details)) is not None:
                    raise error from None
                if code not in RETRYABLE:
                    raise
                start = start or time.monotonic()
                waited = time.monotonic() - start
                if waited >= self.retry_s:
                    hint = "" if self.tls_ca else " (if it serves TLS, pass --tls-ca)"
                    raise UserError(
                        f"cannot reach the server at {self.server} ({what}) for {waited:.0f} s ({details}); "
                        f"check that diloco serve runs there{hint} and the address is right, or raise "
                        "--retry-s."
                    ) from None
                if not warned and waited >= 1.0:
                    log(
                        f"the server at {self.server} does not answer ({what}); "
                        f"retrying for up to {self.retry_s:g} s"
                    )
                    warned = True
                self._pause(min(delay, max(0.0, self.retry_s - waited)))
                delay = min(2 * delay, 2.0)
                continue
            if warned:
                down_s = time.monotonic() - start
                log(f"the server at {self.server} answers again ({what}) after {down_s:.1f} s")
            return result

    def _hopeless(self, what: str, code: grpc.StatusCode, details: str) -> UserError | None:
        """The error of a failed call that retrying does not fix (None: retry): a refusal, a wrong
        token, TLS on one side only, a certificate this worker does not trust."""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            given = "a token that is not the run's" if self.token else "no token"
            return UserError(
                f"the server at {self.server} refused this worker, which sent {given}; pass the "
                "run's token with --token-file FILE or DILOCO_TOKEN (diloco serve printed where "
                "it is)."
            )
        if code in REFUSED:
            return Refused(f"the server at {self.server} refused {what}: {details}.")
        if code not in RETRYABLE:
            return None
        problem = security.tls_problem(self.server, self.tls_ca, details)
        return UserError(problem) if problem else None

    def download(self, rpc: str, request, what: str) -> tuple[pb.JobChunk, bytes]:
        """A streamed answer (GetJob, GetFragment): its header chunk and the bytes of all the
        chunks, checked against the header's length."""
        chunks = getattr(self.stub, rpc)(request, timeout=120.0, metadata=self.meta)
        head = next(chunks)
        blob = b"".join(chunk.data for chunk in chunks)
        if head.status == pb.JobChunk.RUN and len(blob) != head.total_bytes:
            raise UserError(f"{what} came with {len(blob)} bytes, not {head.total_bytes}")
        return head, blob

    def close(self) -> None:
        """Close the channel once grpc's connectivity poller (its own thread, woken every 0.2 s)
        has seen the unsubscription: a channel closed under it can make it raise, and its
        traceback would follow a worker's one-sentence error (seen once in CI)."""
        self.channel.unsubscribe(self._state)
        state = getattr(self.channel, "_connectivity_state", None)  # grpc's; absent: close at once
        deadline = time.monotonic() + 1.0
        while getattr(state, "polling", False) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.channel.close()


class Heartbeat:
    """Tells the server every `every` seconds that this worker is alive (its lease); sets `over`
    when the answer says the run is over, so that a worker mid-job stops before the server,
    which lingers only a few seconds for its stragglers, is gone."""

    def __init__(self, link: Link, ref: pb.WorkerRef, every: float):
        self.link, self.ref, self.every = link, ref, every
        self._stop = threading.Event()
        self.over = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                timeout = max(1.0, self.every)
                reply = self.link.stub.Heartbeat(self.ref, timeout=timeout, metadata=self.link.meta)
            except grpc.RpcError:
                continue  # the job loop finds out, and retries
            if reply.done:
                self.over.set()
                return

    def stop(self) -> None:
        self._stop.set()


def probe_link(link: Link, *, trips: int = 5, least_s: float = 0.5) -> dict[str, float]:
    """The link to the server, measured (diloco plan --probe-link): `latency_ms`, the median of
    `trips` empty round trips (what a message costs besides its bytes), and the Mbit/s down and
    up of a stream of zeros, 1 MB at first and 4× larger until one takes at least `least_s`
    seconds (at most PROBE_MAX_BYTES), less that round trip."""

    def down(n: int) -> float:
        t0 = time.perf_counter()
        got = sum(
            len(c.data)
            for c in link.stub.ProbeDown(pb.ProbeRequest(nbytes=n), timeout=300.0, metadata=link.meta)
        )
        if got != n:
            raise UserError(f"the server at {link.server} sent {got} bytes of a {n}-byte probe; try again.")
        return time.perf_counter() - t0

    def up(n: int) -> float:
        chunks = (pb.ProbeChunk(data=bytes(min(CHUNK_BYTES, n - at))) for at in range(0, n, CHUNK_BYTES))
        t0 = time.perf_counter()
        link.stub.ProbeUp(chunks, timeout=300.0, metadata=link.meta)
        return time.perf_counter() - t0

    try:
        rtt = statistics.median(link.call("a link probe", lambda: down(0)) for _ in range(trips))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        raise UserError(
            f"the server at {link.server} is a diloco older than link probes; upgrade it, or give "
            "--link-mbps."
        ) from None
    result = {"latency_ms": rtt * 1e3}
    for name, fn in (("down_mbps", down), ("up_mbps", up)):
        n = CHUNK_BYTES
        while True:
            took = link.call("a link probe", lambda fn=fn, n=n: fn(n))
            if took - rtt >= least_s or n >= PROBE_MAX_BYTES:
                break
            n = min(4 * n, PROBE_MAX_BYTES)
        result[name] = n * 8 / max(took - rtt, 1e-9) / 1e6
    return result
