"""The status page in a real browser: headless Chromium (Debian's `chromium`, which .ci/run
installs when it is missing) loads the link diloco serve prints and we read what it rendered:
worker rows appear as workers join, the version advances, a refused push is listed. The last
load is also a screenshot (DILOCO_SCREENSHOT=path copies it there: docs/img/status.png)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import grpc
import pytest
from test_server import TOKEN, address, finish, serve, wait_for, worker

from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server import diloco_pb2_grpc as rpc

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    BROWSER is None and not os.environ.get("DILOCO_REQUIRE_BROWSER"),
    reason="no chromium here (.ci/run installs it: apt-get install chromium)",
)


def browse(url: str, profile, *extra: str) -> str:
    """The page's DOM after its scripts ran for 3 s of virtual time (several refreshes)."""
    assert BROWSER is not None, "DILOCO_REQUIRE_BROWSER is set but chromium is not installed"
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--virtual-time-budget=3000", *extra, url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def rendered(dom: str) -> dict:
    refreshes = re.search(r'<body data-refreshes="(\d+)"', dom)
    version = re.search(r'<b id="version">(\d+)</b>', dom)
    return {
        "refreshes": int(refreshes.group(1)) if refreshes else 0,
        "version": int(version.group(1)) if version else None,
        "workers": re.findall(r'<tr data-worker="(\d+)"', dom),
        "rejected": re.findall(r"<td class=\"l\">(unknown_job)</td>", dom),
    }


def status(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{url}/status?token={TOKEN}", timeout=10) as r:
        return json.loads(r.read())


@needs_browser
@pytest.mark.timeout(180)
def test_the_status_page_renders_the_run_live_in_chromium(tmp_path):
    run_dir = tmp_path / "run"
    run = ["--method", "async", "--workers", "2", "--inner-steps", "4", "--rounds", "60"]
    srv = serve(tmp_path, *run, "--eval-every", "8")
    address(run_dir)  # written once the server listens
    url = json.loads((run_dir / "server.json").read_text())["http"]
    page = f"{url}/?token={TOKEN}"

    first = worker(address(run_dir), "--slowdown", "4")
    wait_for(lambda: status(url)["version"] >= 2, what="two updates")
    one = rendered(browse(page, tmp_path / "profile", "--dump-dom"))
    assert one["workers"] == ["0"] and one["version"] >= 2 and one["refreshes"] >= 2, one

    second = worker(address(run_dir), "--slowdown", "8")
    wait_for(lambda: len(status(url)["workers"]) == 2, what="the second worker")
    stub = rpc.ParameterServerStub(grpc.insecure_channel(address(run_dir)))  # a push nobody asked for
    head = pb.PushChunk(run_id=status(url)["run_id"], job=10**6, total_bytes=3, data=b"bad")
    with pytest.raises(grpc.RpcError):
        stub.Push(iter([head]), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
    wait_for(lambda: status(url)["version"] >= one["version"] + 3, what="more updates")
    shot = tmp_path / "status.png"
    browse(page, tmp_path / "profile", "--window-size=1100,900", "--hide-scrollbars", f"--screenshot={shot}")
    two = rendered(browse(page, tmp_path / "profile", "--dump-dom"))
    assert two["workers"] == ["0", "1"] and two["version"] > one["version"], (one, two)
    assert two["rejected"] == ["unknown_job"]
    assert shot.stat().st_size > 10_000
    if os.environ.get("DILOCO_SCREENSHOT"):
        shutil.copy(shot, os.environ["DILOCO_SCREENSHOT"])

    unauthorised = rendered(browse(url + "/", tmp_path / "profile", "--dump-dom"))  # no token: 401
    assert unauthorised["workers"] == [] and unauthorised["version"] is None

    srv.send_signal(2)  # Ctrl-C: the server stops, its workers are told or give up
    finish(srv, timeout=60)
    for w in (first, second):
        w.kill()
    finish(first, second)
