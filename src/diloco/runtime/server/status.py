"""The server's status page: a small HTTP server on its own thread (`--http-port`, default the
gRPC port + 1), behind the run's token like the gRPC service.

    /          a self-contained HTML page (no CDN, no external file) that polls /status every second
    /status    the run as JSON: version, inner steps and budget, ETA, one object per worker,
               the validation loss curve, refused pushes
    /metrics   the same numbers in Prometheus' text format, series named diloco_*

The token goes as `Authorization: Bearer TOKEN` or as `?token=TOKEN` (the link diloco serve
prints); without it every path answers 401. With --tls-cert the page is served over HTTPS.

    curl -H "Authorization: Bearer $(cat runs/srv/token)" http://127.0.0.1:7001/status
"""

from __future__ import annotations

import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from diloco.errors import UserError
from diloco.rundir.metrics import to_json
from diloco.runtime.server import security
from diloco.runtime.server.state import ServerState


def val_curve(run_dir: Path, cache: dict[str, Any]) -> list[list[float]]:
    """[[inner_step, val_loss], ...] of the run's evaluations so far (metrics.jsonl, read anew
    only when it grew)."""
    path = run_dir / "metrics.jsonl"
    try:
        size = path.stat().st_size
    except OSError:
        return []
    if cache.get("size") != size:
        points = []
        with open(path) as f:
            for line in f:
                if '"eval"' not in line:
                    continue
                try:
                    m = json.loads(line)
                except ValueError:  # a line being written
                    continue
                if m.get("kind") == "eval" and m.get("split") == "subset" and m.get("val_loss") is not None:
                    points.append([m["inner_step"], m["val_loss"]])
        cache.update(size=size, points=points)
    return cache["points"]


class Collector:
    """The status as Prometheus metrics (read at each scrape)."""

    def __init__(self, page: StatusPage):
        self.page = page

    def collect(self):
        s = self.page.snapshot()
        yield GaugeMetricFamily(
            "diloco_version", "outer updates applied to the global parameters", s["version"]
        )
        yield CounterMetricFamily("diloco_inner_steps", "inner steps of accepted pushes", s["inner_steps"])
        yield GaugeMetricFamily(
            "diloco_inner_step_budget", "inner steps the run will take", s["inner_step_budget"]
        )
        live = sum(w["state"] != "gone" for w in s["workers"])
        yield GaugeMetricFamily("diloco_workers", "workers registered now", live)
        yield GaugeMetricFamily("diloco_finished", "1 once the run is over", int(s["finished"]))
        if s["val_loss"]:
            yield GaugeMetricFamily("diloco_val_loss", "latest validation loss", s["val_loss"][-1][1])
        rejected = CounterMetricFamily("diloco_rejected", "pushes refused, by reason", labels=["reason"])
        for reason, n in sorted(s["rejected"].items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield CounterMetricFamily(
            "diloco_unauthenticated", "calls refused for a missing or wrong token", s["unauthenticated"]
        )
        push = s["push_seconds"]
        yield SummaryMetricFamily(
            "diloco_push_seconds", "receive-to-acknowledge time of recent pushes", len(push), sum(push)
        )
        per_worker = {
            "step_seconds": ("step_s", GaugeMetricFamily, "measured seconds per inner step"),
            "job_steps": ("steps", GaugeMetricFamily, "inner steps of the current or last job (H_w)"),
            "staleness": ("staleness", GaugeMetricFamily, "staleness of the last applied push"),
            "jobs": ("jobs", CounterMetricFamily, "jobs pushed"),
            "bytes_sent": ("bytes_sent", CounterMetricFamily, "message bytes the worker pushed"),
            "bytes_received": ("bytes_received", CounterMetricFamily, "message bytes the worker pulled"),
        }
        for name, (key, family, doc) in per_worker.items():
            metric = family(f"diloco_worker_{name}", doc, labels=["worker"])
            for w in s["workers"]:
                if w[key] is not None:
                    metric.add_metric([str(w["worker"])], w[key])
            yield metric


class StatusPage:
    """The HTTP server (see the module docstring); `url` is where it listens."""

    def __init__(self, st: ServerState, host: str, port: int):
        self.st = st
        self._curve: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(Collector(self))
        self.html = resources.files("diloco.runtime.server").joinpath("status.html").read_bytes()
        try:
            self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        except OSError as e:
            raise UserError(
                f"cannot serve the status page on {host}:{port} ({e.strerror}); choose another "
                "--http-port (or -1 for none)."
            ) from None
        self.httpd.daemon_threads = True
        scheme = "http"
        if st.opts.tls_cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(st.opts.tls_cert, st.opts.tls_key)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="status-page", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, Any]:
        status = self.st.status()
        with self._lock:
            status["val_loss"] = val_curve(self.st.run_dir, self._curve)
        return status

    def allowed(self, headers, query: str) -> bool:
        token = self.st.token
        if token is None:
            return True
        given = security.bearer(headers.get("Authorization"))
        if given is None:
            given = parse_qs(query).get("token", [None])[0]
        return security.same(given, token)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(page: StatusPage):
    class Handler(BaseHTTPRequestHandler):
        server_version = "diloco"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlsplit(self.path)
            if not page.allowed(self.headers, url.query):
                page.st.refusals.refused(
                    f"{self.client_address[0]}:{self.client_address[1]}",
                    f"GET {url.path}",
                    token_sent="Authorization" in self.headers or "token" in parse_qs(url.query),
                )
                self._send(401, b"this status page needs the run's token\n", "text/plain", auth=True)
            elif url.path == "/":
                self._send(200, page.html, "text/html; charset=utf-8")
            elif url.path == "/status":
                self._send(200, to_json(page.snapshot()).encode(), "application/json")
            elif url.path == "/metrics":
                self._send(200, generate_latest(page.registry), "text/plain; version=0.0.4")
            else:
                self._send(404, b"not found: try /, /status or /metrics\n", "text/plain")

        def _send(self, code: int, body: bytes, kind: str, auth: bool = False) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            if auth:
                self.send_header("WWW-Authenticate", 'Bearer realm="diloco"')
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # requests are not worth a log line
            pass

    return Handler
