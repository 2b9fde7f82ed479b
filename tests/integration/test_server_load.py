"""The server under load and faults, small: 8 real worker processes, two of them killed with
SIGKILL and replaced, and the server itself killed with SIGKILL mid-run (between two
checkpoints, so that its resume replays pushes from the write-ahead log) and resumed. No
acknowledged push may be lost or applied twice, and the run replays bit for bit
(benchmarks/server_load.py runs the 32-worker version)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from diloco.run.replay import replay

_spec = importlib.util.spec_from_file_location(
    "server_load", Path(__file__).resolve().parents[2] / "benchmarks" / "server_load.py"
)
server_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_load)


@pytest.mark.slow  # ~40 s: kept out of the default run for its 10-minute budget (make test-all)
@pytest.mark.timeout(240)
def test_eight_workers_two_killed_and_the_server_killed_lose_nothing(tmp_path):
    report = server_load.run_load(
        workers=8,
        rounds=8,
        worker_kills=2,
        time_limit_s=200.0,
        root=tmp_path,
        log=lambda text: None,
    )
    assert report["server_kills"] == 1 and report["worker_kills"] == 2, report
    assert report["server_finished"], (tmp_path / "server.log").read_text()[-3000:]
    assert report["pushes_acknowledged"] > 8 * 4, report
    # the kill came between checkpoints: the resume replayed acknowledged pushes from the log
    assert report["wal_events_replayed"] and report["wal_events_replayed"][0] >= 10, report
    assert report["duplicates_applied"] == 0 and report["lost_acknowledged"] == 0, report
    assert report["pushes_applied"] == report["pushes_logged"] and report["ok"]
    assert replay(tmp_path / "run")["bitwise_equal"]
