"""Who may talk to the parameter server: the run's token, TLS, and the gRPC interceptor that
refuses calls without the token before any handler runs.

The token is a shared secret of the run: `--token-file FILE` or `DILOCO_TOKEN`, else one is
generated and written to RUN_DIR/token (mode 0600). Workers send it with every call as gRPC
metadata (`authorization: Bearer TOKEN`); the status page takes it as a bearer token or a
`?token=` query. Comparisons take constant time (`hmac.compare_digest`). With TLS
(`--tls-cert/--tls-key`, workers `--tls-ca`) the token and the tensors are encrypted on the way.

    diloco serve --token-file secret.txt --tls-cert server.pem --tls-key server.key
    DILOCO_TOKEN=$(cat secret.txt) diloco worker --server host:7000 --tls-ca ca.pem
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from diloco.errors import UserError

ENV = "DILOCO_TOKEN"
HEADER = "authorization"  # gRPC metadata keys are lower case
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class ServeOptions:
    """How `diloco serve` faces the network (none of it goes into config.json: the token is a
    secret, and the rest may change on --resume)."""

    listen: str = "127.0.0.1:7000"
    token_file: Path | None = None
    insecure_no_token: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    http_port: int | None = None  # None: the gRPC port + 1 (0 when that is 0); -1: no status page


def _read_token(path: Path, what: str) -> str:
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"cannot read the token file {path} ({e}); give {what} a readable text file."
        ) from None
    return check_token(token, str(path))


def check_token(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token) or not token.isprintable():
        raise UserError(
            f"the token in {where} must be at least {MIN_TOKEN_CHARS} printable characters without spaces; "
            "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return token


def given_token(token_file: Path | None) -> str | None:
    """The token given on this side (server or worker): --token-file, else DILOCO_TOKEN, checked;
    None when neither is set."""
    if token_file is not None:
        return _read_token(token_file, "--token-file")
    if os.environ.get(ENV):
        return check_token(os.environ[ENV].strip(), f"${ENV}")
    return None


def explicit_token(opts: ServeOptions) -> str | None:
    """The server's given token (see `given_token`), refused together with --insecure-no-token.
    diloco serve calls it before anything is written, so a bad token file leaves no run behind."""
    token = given_token(opts.token_file)
    if opts.insecure_no_token and token is not None:
        raise UserError(f"--insecure-no-token with --token-file or {ENV}: choose one.")
    return token


def server_token(opts: ServeOptions, run_dir: Path) -> str | None:
    """The run's token: the one given, else RUN_DIR/token (made now, mode 0600, if it is not
    there from an earlier start). None with --insecure-no-token."""
    token = explicit_token(opts)
    if token is not None or opts.insecure_no_token:
        return token
    path = run_dir / "token"
    if path.exists():
        return _read_token(path, "diloco serve (or delete it for a new token)")
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def same(given: str | None, token: str) -> bool:
    """Whether `given` is the token, in time that does not depend on where they differ."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def bearer(value: str | None) -> str | None:
    """The token of an `authorization: Bearer TOKEN` value (None when it is not one)."""
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {what} {path} ({e.strerror}); give the PEM file's path.") from None


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    """gRPC's credentials from a PEM certificate and its key, checked first with Python's ssl
    (gRPC refuses a bad pair only when the port is bound, saying nothing of why)."""
    key_pem, cert_pem = _read(key, "--tls-key"), _read(cert, "--tls-cert")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise UserError(
            f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its private key "
            f"({e.reason or e}); give the pair made for this server (docs/server.md)."
        ) from None
    return grpc.ssl_server_credentials([(key_pem, cert_pem)])


def channel_credentials(ca: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "--tls-ca"))


def _handshake(server: str, ca: Path | None) -> dict | None:
    """A TLS handshake with the server at HOST:PORT, checking its certificate against `ca` but not
    its name: the certificate (as ssl's getpeercert; empty without `ca`), None when it fails."""
    host, _, port = server.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    context.verify_mode = ssl.CERT_NONE if ca is None else ssl.CERT_REQUIRED
    try:
        if ca is not None:
            context.load_verify_locations(cafile=ca)
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5.0) as sock:
            with context.wrap_socket(sock) as tls:
                return tls.getpeercert() or {}
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return None


def tls_problem(server: str, ca: Path | None, details: str) -> str | None:
    """What gRPC's message (`details`) of a failed connection to `server` says about TLS, as one
    sentence: TLS on one side only, a certificate not signed by `ca` (the worker's --tls-ca) or not
    for the name or address dialled. None when it says nothing about TLS: retrying may help."""
    if ca is None:  # a TLS server closes a plaintext connection: ask it for a handshake
        closed = "Socket closed" in details or "reset by peer" in details
        if closed and _handshake(server, None) is not None:
            return (
                f"the server at {server} serves TLS; pass --tls-ca with the CA that signed its "
                "certificate (or the certificate itself)."
            )
        return None
    if "WRONG_VERSION_NUMBER" in details:
        return (
            f"the server at {server} does not speak TLS; drop --tls-ca, or start the server with "
            "--tls-cert and --tls-key."
        )
    if "Hostname Verification" in details:
        cert = _handshake(server, ca) or {}
        names = ", ".join(f"{kind} {value}" for kind, value in cert.get("subjectAltName", ()))
        return (
            f"the certificate of the server at {server} is for {names or 'other names'}, not for "
            f"{server.rpartition(':')[0]}; give --server one of those, or the server a certificate "
            "for this address (docs/server.md, Certificates)."
        )
    if any(s in details.lower() for s in ("handshake", "certificate", "ssl", "tls")):
        return (
            f"the TLS handshake with {server} failed: its certificate is not signed by --tls-ca {ca} "
            f"or is not for this address ({details}); give the CA that signed the server's certificate."
        )
    return None


class Refusals:
    """Unauthenticated calls: counted, one log line per caller (and missing or wrong token) every
    `every` seconds (someone hammering the port cannot flood the log)."""

    def __init__(self, log: Callable[[str], None], every: float = 10.0):
        self.log, self.every = log, every
        self.count = 0
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()  # called from gRPC's and the status page's threads

    def refused(self, peer: str, method: str, token_sent: bool) -> None:
        key = (peer.rsplit(":", 1)[0], token_sent)
        now = time.monotonic()
        with self._lock:
            self.count += 1
            count, say = self.count, now - self._last.get(key, -self.every) >= self.every
            if say:
                self._last[key] = now
        if say:
            how = "with a wrong token" if token_sent else "without a token"
            self.log(f"refused a call {how} from {peer} ({method}; {count} so far)")


class AuthInterceptor(grpc.ServerInterceptor):
    """Lets a call through only if its metadata carries the run's token; else UNAUTHENTICATED,
    before any handler (and so any state) is touched."""

    def __init__(self, token: str, refusals: Refusals):
        self.token, self.refusals = token, refusals

    def intercept_service(self, continuation, details):
        meta = dict(details.invocation_metadata or ())
        given = bearer(meta.get(HEADER))
        if same(given, self.token):
            return continuation(details)
        handler = continuation(details)
        method = details.method.rsplit("/", 1)[-1]

        def refuse(request_or_iterator, ctx):
            self.refusals.refused(ctx.peer(), method, token_sent=given is not None)
            ctx.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this server needs the run's token (missing or wrong)",
            )

        if handler is None:
            return None
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
