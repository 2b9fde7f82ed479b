"""diloco plan --probe-link against a real `diloco serve` on loopback: the link is measured with
the run's token (and refused without it), the measurement becomes every worker's link and
latency in the plan, and probing touches nothing of the run."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from test_server import ENV, TOKEN, address, events, serve

from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server import diloco_pb2_grpc as rpc
from diloco.runtime.server.wire import PROBE_MAX_BYTES


def _plan(*args: str, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "diloco", "plan", "--workers", "2", "--step-s", "0.5", *args]
    return subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(180)
def test_probe_link_measures_a_real_server(tmp_path):
    server = serve(tmp_path, "--workers", "2")
    try:
        run_dir = tmp_path / "run"
        where = address(run_dir)
        before = events(run_dir)
        no_token = {k: v for k, v in ENV.items() if k != "DILOCO_TOKEN"}
        (tmp_path / "token").write_text(TOKEN)
        done = _plan("--probe-link", where, "--token-file", str(tmp_path / "token"), "--json", env=no_token)
        assert done.returncode == 0, done.stderr
        assert "ms round trip" in done.stderr and "Mbit/s down" in done.stderr
        p = json.loads(done.stdout)
        assert p["wall_time_s"] > 0 and 0 < p["utilisation"]["mean"] <= 1
        # the plan is the one for the measured link given by hand: the slower way, and its latency
        probed = p["probed_link"]
        assert probed["down_mbps"] > 100 and probed["up_mbps"] > 100  # loopback
        slower = min(probed["down_mbps"], probed["up_mbps"])
        by_hand = _plan("--link-mbps", repr(slower), "--latency-ms", repr(probed["latency_ms"]), "--json")
        assert by_hand.returncode == 0, by_hand.stderr
        same = json.loads(by_hand.stdout)
        assert same["wall_time_s"] == p["wall_time_s"] and same["utilisation"] == p["utilisation"]
        # loopback: far faster than any WAN link, and a round trip well under a second
        said = done.stderr.split("--probe-link")[1]
        assert float(said.split(":")[-1].split(" ms")[0].strip()) < 1000
        # no token: refused with one sentence naming what to pass
        bare = _plan("--probe-link", where, env=no_token)
        assert bare.returncode == 2 and "--token-file" in bare.stderr and bare.stderr.count("\n") == 1
        both = _plan("--probe-link", where, "--link-mbps", "10")
        assert both.returncode == 2 and "not both" in both.stderr
        # a probe larger than the limit is refused by the server itself
        channel = grpc.insecure_channel(where)
        stub = rpc.ParameterServerStub(channel)
        meta = (("authorization", f"Bearer {TOKEN}"),)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ProbeDown(pb.ProbeRequest(nbytes=PROBE_MAX_BYTES + 1), timeout=10, metadata=meta))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            sum(len(c.data) for c in stub.ProbeDown(pb.ProbeRequest(nbytes=3_000_001), metadata=meta))
            == 3_000_001
        )
        reply = stub.ProbeUp(iter([pb.ProbeChunk(data=b"x" * 1000)] * 3), timeout=10, metadata=meta)
        assert reply.nbytes == 3000
        channel.close()
        assert events(run_dir) == before  # no worker joined, nothing recorded
    finally:
        server.kill()
        server.communicate()
