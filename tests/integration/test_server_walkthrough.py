"""docs/server.md's walkthrough, run as written: two network namespaces joined by a virtual cable
stand in for a server machine and a worker machine; the certificates come from the docs' recipe
for the server's address; the server listens on every interface with TLS and a token file; two
workers on the other "machine" finish the run. Needs root and iproute2's `ip`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from test_server_security import NO_TOKEN_ENV, docs_block


def _kill_and_delete(namespace: str) -> None:
    """Stop what this test started in `namespace`, then delete it (if it exists)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's ip to make network namespaces")
@pytest.mark.skipif(shutil.which("openssl") is None, reason="the docs' certificate recipe needs openssl")
def test_the_docs_walkthrough_two_machines_tls_and_a_token(tmp_path):
    server_ns, worker_ns = f"dl-server-{os.getpid()}", f"dl-worker-{os.getpid()}"  # parallel runs
    probe = subprocess.run(["ip", "netns", "add", server_ns], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", server_ns], check=True)
    recipe = re.sub(r"^SAN=.*$", 'SAN="IP:10.99.0.1"', docs_block("### Certificates"), count=1, flags=re.M)
    walk = docs_block("### Walkthrough")
    walk = walk.replace("dl-server", server_ns).replace("dl-worker", worker_ns)
    walk = re.sub(r"\bdiloco (serve|worker)\b", rf"{sys.executable} -m diloco \1", walk)
    walk = re.sub(r"^python ", f"{sys.executable} ", walk, flags=re.M)
    log = tmp_path / "walkthrough.log"  # a file, not a pipe: a failed step ends the script at once
    try:
        with open(log, "w") as out:
            rc = subprocess.run(
                ["bash", "-ec", recipe + walk],
                cwd=tmp_path,
                env={**NO_TOKEN_ENV, "OMP_NUM_THREADS": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=300,
            ).returncode
    finally:
        _kill_and_delete(server_ns)
        _kill_and_delete(worker_ns)
    said = log.read_text()
    assert rc == 0, said
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert server_ns not in namespaces and worker_ns not in namespaces
    assert "joined 10.99.0.1:7000 as worker" in said
    assert said.count("the run at 10.99.0.1:7000 is done") == 2, said
    assert (tmp_path / "runs" / "two" / "summary.json").exists()
