"""benchmarks/merge_ledgers.py on real files: rows from worktree copies join the ledger in git."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "merge_ledgers.py"


def _mod():
    spec = importlib.util.spec_from_file_location("merge_ledgers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path, rows, **kw):
    path.write_text("".join(json.dumps(r, **kw) + "\n" for r in rows))


@pytest.mark.timeout(30)
def test_a_reproduce_ledger_gains_new_rows_sorted_and_a_curve_for_a_rebuilt_row(tmp_path):
    into, copy = tmp_path / "runs.jsonl", tmp_path / "copy.jsonl"
    b_old = {"name": "b", "summary": {"val_loss": 2.0}, "curve": []}
    _write(into, [{"name": "c", "summary": {"val_loss": 1.0}, "curve": [[0, 3.0]]}, b_old], sort_keys=True)
    b_new = {"name": "b", "summary": {"val_loss": 2.0}, "curve": [[0, 3.0], [50, 2.0]]}
    c_other = {"name": "c", "summary": {"val_loss": 1.0}, "curve": [[0, 9.0]]}  # the ledger's has a curve
    _write(copy, [{"name": "a", "summary": {"val_loss": 1.5}}, b_new, c_other])
    assert _mod().merge(into, [copy]) == 1
    rows = [json.loads(x) for x in into.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["a", "b", "c"]
    assert rows[1]["curve"] == [[0, 3.0], [50, 2.0]] and rows[2]["curve"] == [[0, 3.0]]


@pytest.mark.timeout(30)
def test_a_rebuilt_row_whose_run_again_differs_stops_the_merge(tmp_path):
    into, copy = tmp_path / "runs.jsonl", tmp_path / "copy.jsonl"
    _write(into, [{"name": "b", "summary": {"val_loss": 2.0}, "curve": []}])
    _write(copy, [{"name": "b", "summary": {"val_loss": 2.1}, "curve": [[0, 3.0]]}])
    with pytest.raises(SystemExit, match="not deterministic"):
        _mod().merge(into, [copy])
    assert json.loads(into.read_text())["summary"]["val_loss"] == 2.0  # untouched


@pytest.mark.timeout(30)
def test_an_async_jitter_ledger_keeps_its_lines_and_appends_new_runs_in_order(tmp_path):
    into, a, b = tmp_path / "l.jsonl", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    into.write_text('{"run": "x",  "val_loss": 1}\n')  # odd spacing survives: lines are kept as written
    _write(a, [{"run": "x", "val_loss": 1}, {"run": "z", "val_loss": 3}])
    _write(b, [{"run": "y", "val_loss": 2}, {"run": "z", "val_loss": 3}])
    assert _mod().merge(into, [a, b]) == 2
    lines = into.read_text().splitlines()
    assert lines[0] == '{"run": "x",  "val_loss": 1}'
    assert [json.loads(x)["run"] for x in lines] == ["x", "z", "y"]


@pytest.mark.timeout(60)
def test_a_lane_part_timing_joins_the_one_in_git_part_by_part(tmp_path):
    """The lane's copy counted more runs of dp (it ran them); its single is the seed's copy of an
    older entry, H500 is new, and its drop has as many runs over more time (recorded while a run
    was in flight): dp, H500 and drop are taken, single stays; run as a command, as the lane's
    sessions do."""
    git, lane = tmp_path / "git", tmp_path / "lane"
    git.mkdir(), lane.mkdir()
    _write(git / "runs.jsonl", [{"name": "a", "summary": {"val_loss": 1.0}, "curve": [[0, 2.0]]}])
    _write(lane / "runs.jsonl", [{"name": "b", "summary": {"val_loss": 1.5}, "curve": [[0, 2.0]]}])
    mine = {
        "dp": {"elapsed_s": 100.0, "new_runs": 10},
        "single": {"elapsed_s": 50.0, "new_runs": 5},
        "drop": {"elapsed_s": 70.0, "new_runs": 3},
        "codec": {"elapsed_s": None, "new_runs": 2},  # a hand-edited entry: null counts as 0
    }
    theirs = {
        "dp": {"elapsed_s": 900.0, "new_runs": 14},
        "single": {"elapsed_s": 40.0, "new_runs": 4},
        "H500": {"elapsed_s": 10.0, "new_runs": 1},
        "drop": {"elapsed_s": 95.0, "new_runs": 3},
        "codec": {"elapsed_s": 5.0, "new_runs": 2},
    }
    (git / "part_timing.json").write_text(json.dumps(mine, indent=2) + "\n")
    (lane / "part_timing.json").write_text(json.dumps(theirs, indent=2) + "\n")
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(git / "runs.jsonl"), str(lane / "runs.jsonl")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "1 rows added" in out.stderr and "dp, H500, drop, codec taken" in out.stderr
    got = json.loads((git / "part_timing.json").read_text())
    assert got == {**theirs, "single": mine["single"]}
    assert (git / "part_timing.json").read_text().endswith("}\n")
