"""Where a server run is reached: the gRPC service (handlers.py) and the status page (status.py)
started on the run's address, RUN_DIR/server.json (which --resume reads), the lines that tell
how to start workers, and the shutdown that lets every worker hear that the run is over.

    endpoint = Endpoint(state, opts, lock)
    endpoint.start()      # listens; endpoint.address is HOST:PORT
    endpoint.announce()   # "serving RUN_DIR on ...; start workers with: diloco worker --server ..."
    endpoint.close(clean=True)
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time
from concurrent import futures

import grpc

from diloco import rundir
from diloco.errors import UserError
from diloco.rundir import checkpoint
from diloco.runtime.server import diloco_pb2_grpc as rpc
from diloco.runtime.server import security
from diloco.runtime.server.handlers import Handlers
from diloco.runtime.server.security import ServeOptions
from diloco.runtime.server.state import ServerState, log
from diloco.runtime.server.wire import CHUNK_BYTES

SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of a network interface


class Endpoint:
    """The run's gRPC server and status page (see the module docstring); `address` is where the
    gRPC server listens once started (None before)."""

    def __init__(self, state: ServerState, opts: ServeOptions, lock):
        self.state, self.opts, self._lock = state, opts, lock  # lock: the run directory's
        self.server: grpc.Server | None = None
        self.address: str | None = None
        self.status_page = None

    def start(self) -> None:
        """Listen on --host:--port (and the status page on its port), then write server.json."""
        st, opts = self.state, self.opts
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4 * st.cfg.num_workers + 8),
            interceptors=[security.AuthInterceptor(st.token, st.refusals)] if st.token else [],
            options=[("grpc.max_receive_message_length", 4 * CHUNK_BYTES), ("grpc.so_reuseport", 0)],
        )
        rpc.add_ParameterServerServicer_to_server(Handlers(st), server)
        host, _, port = opts.listen.rpartition(":")
        tls = opts.tls_cert is not None
        credentials = security.server_credentials(opts.tls_cert, opts.tls_key) if tls else None
        try:
            if tls:
                bound = server.add_secure_port(opts.listen, credentials)
            else:
                bound = server.add_insecure_port(opts.listen)
        except RuntimeError:
            bound = 0
        if not bound:
            raise UserError(
                f"cannot listen on {opts.listen} (in use, or not this machine's address); "
                "choose another --port."
            )
        server.start()
        self.server, self.address = server, f"{host}:{bound}"
        if opts.http_port != -1:
            from diloco.runtime.server.status import StatusPage

            want = (bound + 1 if int(port) else 0) if opts.http_port is None else opts.http_port
            self.status_page = StatusPage(st, host, want)
        http_port = int(self.status_page.url.rsplit(":", 1)[1]) if self.status_page else -1
        token = self._token_source()
        info = {
            "address": self.address,
            "run_id": st.run_id,
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
        checkpoint.atomic_write_json(st.run_dir / "server.json", info, indent=None)  # --resume reads it
        rundir.say_holder(self._lock, f"pid {os.getpid()}, serving on {self.address}")
        self._host, self._bound, self._http_port, self._token = host, bound, http_port, token

    def announce(self) -> None:
        """Say on stderr how workers reach the run (addresses other machines can use when it
        listens on every interface), where the status page is, and where the token came from."""
        st, host, bound, token = self.state, self._host, self._bound, self._token
        tls = self.opts.tls_cert is not None
        shown = reachable_hosts() if host in ("0.0.0.0", "::", "[::]", "") else [host]
        flags = (" --tls-ca CA.pem" if tls else "") + (" --token-file TOKEN_FILE" if st.token else "")
        also = f" (this machine is also {', '.join(shown[1:])})" if len(shown) > 1 else ""
        log(
            f"serving {st.run_dir} on {self.address}; "
            f"start workers with: diloco worker --server {shown[0]}:{bound}{flags}{also}"
        )
        if st.token is None:
            log(
                "WARNING: --insecure-no-token: anyone who can reach this port can join the run and push "
                "updates; use it on loopback only"
            )
        elif token == "generated":
            log(f"the workers' token is in {st.run_dir / 'token'} (give it to them with --token-file)")
        mb = st.max_message_bytes / 1e6
        log(
            f"receiving at most {st.push_slots.limit} pushes at once (--max-inflight-pushes; up to "
            f"{mb:.0f} MB each); more wait their turn"
        )
        if not st.coord.sync:
            log(
                f"holding θ for at most {st.downloads['limit']} downloads at once (--max-inflight-downloads; "
                f"{st.side.pull_bytes / 1e6:.0f} MB each); a job waits for one"
            )
        if self.status_page:
            query = f"?token={st.token}" if st.token else ""
            log(f"status page: {'https' if tls else 'http'}://{shown[0]}:{self._http_port}/{query}")

    def _token_source(self) -> str:
        """Where the run's token came from, for --resume: file, env, generated (RUN_DIR/token), none."""
        given, st = self.opts.token_file, self.state
        if st.token is None:
            return "none"
        if given is not None:
            return "generated" if given.resolve() == (st.run_dir / "token").resolve() else "file"
        return "env" if os.environ.get(security.ENV) else "generated"

    def close(self, *, clean: bool = True) -> None:
        """Stop serving; `clean`: first let every worker hear that the run is over."""
        st = self.state
        if self.server is not None:
            if clean:  # let every worker hear that the run is over, stragglers too (a late
                # push, a lease that ran out): each asks for a job every few seconds
                limit = time.monotonic() + min(10.0, st.cfg.worker_timeout_s)
                with st.cond:
                    while time.monotonic() < limit and st.untold():
                        st.cond.wait(0.1)
            self.server.stop(grace=1.0).wait()
        if self.status_page is not None:
            self.status_page.close()


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
