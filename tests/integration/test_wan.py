"""benchmarks/wan.py's shaped links, without training: two network namespaces joined by a veth
pair, each end limited by tbf; a TCP transfer between them runs at the rate, and the namespaces
are gone afterwards, also when the body raises. The star (a hub namespace, a veth pair to each
worker namespace): a worker reaches the hub's server address through its own shaped pair, and
everything is deleted afterwards. Needs root, `ip` and `tc` (skipped otherwise)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "wan", Path(__file__).resolve().parents[2] / "benchmarks" / "wan.py"
)
wan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wan)

pytestmark = pytest.mark.skipif(wan.missing() is not None, reason=wan.missing() or "")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _veths() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def _devices(ns: str | None = None) -> set[str]:
    """The interface names in namespace ns (None: ours), without their `@peer` suffixes."""
    cmd = ["ip", "-o", "link"] if ns is None else ["ip", "-n", ns, "-o", "link"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.strip()}


@pytest.mark.timeout(60)
def test_a_shaped_transfer_runs_at_the_rate_and_the_namespaces_are_deleted():
    with wan.Link(20) as link:
        assert set(link.ns) <= _namespaces()
        assert link.burst_bytes == 10_000  # 20 Mbit/s ÷ 250 Hz, over the 32 kbit floor
        shown = subprocess.run(
            ["tc", "-n", link.ns[0], "qdisc", "show", "dev", link.dev[0]], capture_output=True, text=True
        ).stdout
        assert "tbf" in shown and "20Mbit" in shown, shown
        mbps = link.measure_mbps(2_000_000)
        back = link.measure_mbps(2_000_000, sender=0)
    assert 14 <= mbps <= 26 and 14 <= back <= 26, (mbps, back)  # 20 Mbit/s ± 30%
    assert not set(link.ns) & _namespaces()
    assert link.dev[0] not in _veths() and link.dev[1] not in _veths()
    assert not wan._LIVE and not wan._CHILDREN


@pytest.mark.timeout(30)
def test_the_namespaces_are_deleted_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with wan.Link(20) as link:
            assert set(link.ns) <= _namespaces()
            raise RuntimeError("boom")
    assert not set(link.ns) & _namespaces()
    assert link.dev[0] not in _veths()
    # and a link that atexit would clean: cleanup_all deletes every live one
    other = wan.Link().open()
    assert set(other.ns) <= _namespaces()
    wan.cleanup_all()
    assert not set(other.ns) & _namespaces() and not wan._LIVE


@pytest.mark.timeout(60)
def test_a_star_worker_reaches_the_hub_at_the_rate_and_everything_is_deleted():
    with wan.Star(2, 20) as star:
        hub, one, two = star.ns
        assert set(star.ns) <= _namespaces()
        assert _devices(hub) == {"lo", *(p.dev[0] for p in star.pairs)}  # one pair per worker
        assert _devices(one) == {"lo", star.pairs[0].dev[1]} and _devices(two) == {"lo", star.pairs[1].dev[1]}
        assert len({p.addr[0].rsplit(".", 1)[0] for p in star.pairs}) == 2  # a /24 each
        for p in star.pairs:
            for ns, dev in zip(p.ns, p.dev):
                shown = subprocess.run(
                    ["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True
                ).stdout
                assert "tbf" in shown and "20Mbit" in shown, (ns, dev, shown)
        # worker 2 reaches the server's address (the hub end of worker 1's pair) through its own
        # pair and its default route, and the hub reaches worker 2
        assert star.hub_addr == star.pairs[0].addr[0]
        up = star.measure_mbps(1_000_000, worker=2, to=star.hub_addr)
        down = star.measure_mbps(1_000_000, worker=2, sender=0)
    assert 14 <= up <= 26 and 14 <= down <= 26, (up, down)  # 20 Mbit/s ± 30%
    assert not set(star.ns) & _namespaces()
    assert not {d for p in star.pairs for d in p.dev} & _devices()
    assert not wan._LIVE and not wan._CHILDREN
