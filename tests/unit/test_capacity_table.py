"""docs/server.md's capacity table is the one benchmarks/server_capacity.py computes from its
measured rows (results/server_capacity.json), and the JSON's `capacity` is what its rows give."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "server_capacity", ROOT / "benchmarks" / "server_capacity.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(30)
def test_the_docs_capacity_table_is_the_one_the_measured_rows_give():
    bench = _bench()
    saved = json.loads((ROOT / "benchmarks" / "results" / "server_capacity.json").read_text())
    cap = bench.capacity(saved["rows"])
    assert cap == saved["capacity"]  # recomputed from the rows: the JSON's table is theirs
    doc = (ROOT / "docs" / "server.md").read_text()
    block = re.search(r"<!-- capacity table:[^\n]*-->\n(.*?)\n<!-- end of capacity table -->", doc, re.S)
    assert block is not None, "docs/server.md has no capacity table block"
    assert block.group(1) == bench.capacity_markdown(cap)


@pytest.mark.timeout(30)
def test_a_resource_that_runs_out_first_is_the_smallest_rate_and_workers_grow_with_h():
    bench = _bench()
    rows = json.loads((ROOT / "benchmarks" / "results" / "server_capacity.json").read_text())["rows"]
    for t in bench.capacity(rows)["table"]:
        rates = t["pushes_per_s"]
        assert t["runs_out_first"] == min(rates, key=rates.get)
        assert t["server_pushes_per_s"] == rates[t["runs_out_first"]]
        assert t["workers_H500"] >= 5 * t["workers_H100"] - 5 * 0.1  # rounded down each


@pytest.mark.timeout(30)
def test_a_row_whose_push_files_do_not_fit_its_storage_is_refused_with_a_sentence(tmp_path):
    import shutil

    bench = _bench()
    free = shutil.disk_usage(tmp_path).free
    assert bench.no_room(tmp_path, 1 << 20) is None
    problem = bench.no_room(tmp_path, free + (1 << 30))
    assert problem.startswith("the run's push files") and "--storage disk" in problem


@pytest.mark.timeout(30)
def test_a_tmpfs_row_is_refused_when_its_push_files_would_take_half_the_memory():
    bench = _bench()
    shm = Path("/dev/shm")
    if not shm.is_dir() or not bench.memory_backed(shm):
        pytest.skip("no tmpfs at /dev/shm")
    available = bench.mem_available()
    assert available > 0 and not bench.memory_backed(Path(__file__).parent)
    assert bench.no_room(shm, 1 << 20) is None
    problem = bench.no_room(shm, int(0.6 * available))  # fits the tmpfs, not the memory
    assert "half of the memory left" in problem and "--storage disk" in problem
