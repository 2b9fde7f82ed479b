"""benchmarks/async_jitter.py's report: its paired percentages, speedups, pick and targets match a
hand computation on a ledger written here, and `--report-only` reports the seeds whose runs are all
in the ledger, runs nothing, and counts what is missing. No training run is started."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def aj():
    sys.path.insert(0, str(BENCH))  # async_jitter imports async_vs_sync
    spec = importlib.util.spec_from_file_location("async_jitter", BENCH / "async_jitter.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    sys.path.remove(str(BENCH))


# sync falls from 3.0 to 2.0 by t = 100; its final loss 2.0 is every speedup's target
SYNC = {"val_loss": 2.0, "outer_updates": 8, "mean_staleness": 0.0}
SYNC["curve"] = [[0, 3.0], [50, 2.5], [100, 2.0]]


def _rec(loss: float, curve: list, updates: int = 30, stale: float = 1.5) -> dict:
    return {"val_loss": loss, "outer_updates": updates, "mean_staleness": stale, "curve": curve}


@pytest.mark.timeout(30)
def test_cell_pairs_each_seed_with_its_sync_run_and_times_the_curve_to_syncs_loss(aj):
    records = {
        "sync-s0": SYNC,
        "sync-s1": {**SYNC, "val_loss": 2.2, "curve": [[0, 3.0], [100, 2.2]]},
        # seed 0: reaches 2.0 halfway between t = 20 (2.2) and t = 40 (1.8): at 30, speedup 100/30
        "fast-s0": _rec(1.9, [[0, 3.0], [20, 2.2], [40, 1.8]]),
        # seed 1: reaches 2.2 exactly at t = 25: speedup 4
        "fast-s1": _rec(2.09, [[0, 3.0], [25, 2.2], [50, 2.1]], updates=34, stale=2.5),
        "slow-s0": _rec(2.1, [[0, 3.0], [100, 2.1]]),  # never reaches 2.0
        "slow-s1": _rec(2.2, [[0, 3.0], [200, 2.2]]),
    }
    table = aj.cell(records, ["sync", "fast", "slow"], [0, 1])
    fast = table["fast"]
    assert fast["vs_sync_pct_by_seed"] == [pytest.approx(-5.0), pytest.approx(-5.0)]
    assert fast["vs_sync_pct"] == pytest.approx(-5.0)
    assert fast["speedup_by_seed"] == [round(100 / 30, 3), 4.0]
    assert fast["min_speedup"] == round(100 / 30, 3)
    assert fast["val_loss"] == {"mean": 1.995, "min": 1.9, "max": 2.09}
    assert fast["outer_updates_mean"] == 32 and fast["mean_staleness"] == 2.0
    slow = table["slow"]
    assert slow["speedup_by_seed"] == [None, 0.5] and slow["min_speedup"] is None
    assert slow["vs_sync_pct_by_seed"] == [pytest.approx(5.0), pytest.approx(0.0)]
    assert table["sync"]["min_speedup"] == 1.0
    # the pick: fast reaches sync's loss on every seed with the lowest loss
    assert aj.recommend(table) == "fast"


def _row(loss: float, speedup: float | None) -> dict:
    return {"val_loss": {"mean": loss}, "min_speedup": speedup}


@pytest.mark.timeout(30)
def test_the_pick_is_the_fastest_of_the_methods_whose_loss_ties_with_the_best(aj):
    table = {
        "sync": _row(2.0, 1.0),
        "a": _row(1.900, 3.3),  # the lowest loss
        "b": _row(1.909, 5.1),  # within 0.5% of it and faster: the pick
        "c": _row(1.800, None),  # lower still, but misses sync's loss on a seed: never picked
        "d": _row(1.911, 9.0),  # fastest, but 0.58% above the best
    }
    assert aj.recommend(table) == "b"
    table["b"] = _row(1.9100, 5.1)  # now 0.526% above a: no longer a tie
    assert aj.recommend(table) == "a"


@pytest.mark.timeout(30)
def test_targets_need_every_cell_at_both_jitters_in_both_scenarios_with_all_seeds(aj):
    result = {}
    for prefix in ("", "warm_"):
        for j in ("0.1", "0.2"):
            result[f"{prefix}best_async_method_j{j}"] = "dn_dylu_time"
            result[f"{prefix}best_async_vs_sync_pct_j{j}"] = -4.0
            result[f"{prefix}best_async_min_speedup_j{j}"] = 5.0
            result[f"{prefix}seeds_j{j}"] = [0, 1, 2, 3, 4]
    assert aj.targets(result, 5)["met"]
    result["warm_best_async_min_speedup_j0.2"] = 2.49
    t = aj.targets(result, 5)
    assert not t["met"] and t["cells"]["warm_j0.2"] == {
        "method": "dn_dylu_time",
        "seeds": 5,
        "loss_met": True,
        "speedup_met": False,
    }
    result["warm_best_async_min_speedup_j0.2"] = None  # a seed never reached sync's loss
    assert not aj.targets(result, 5)["cells"]["warm_j0.2"]["speedup_met"]
    result["warm_best_async_min_speedup_j0.2"] = 2.5
    result["best_async_vs_sync_pct_j0.1"] = 1.01
    assert not aj.targets(result, 5)["met"]
    result["best_async_vs_sync_pct_j0.1"] = 1.0
    assert aj.targets(result, 5)["met"]
    result["seeds_j0.2"] = [0, 1, 2, 3]  # a cell short of a seed
    assert not aj.targets(result, 5)["met"]
    del result["warm_best_async_method_j0.1"]  # a cell not reported yet
    result["seeds_j0.2"] = [0, 1, 2, 3, 4]
    assert not aj.targets(result, 5)["met"]


def _ledger_line(aj, run: str, lr: float, seed: int, jitter: float, rec: dict) -> str:
    settings = {"outer_lr": lr, "seed": seed, "speed_jitter": jitter, "threads": aj.THREADS}
    return json.dumps({"run": run, "settings": settings, **rec})


@pytest.mark.timeout(60)
def test_report_only_reports_complete_seeds_and_counts_missing_runs_without_running(aj, tmp_path):
    lrs = {"sync": 1.0, "dn_dylu_time": 1.0}
    probe = {"final_val_loss": {"sync": {"1": 2.0}, "dn_dylu_time": {"1": 1.9}}}
    (tmp_path / "async_jitter_outer_lr.json").write_text(
        json.dumps({"best_outer_lr": lrs, "warm_probe": probe})
    )
    lines = []
    for seed in (0, 1):  # seed 2 has sync only: left out of the cell
        lines.append(_ledger_line(aj, f"scratch/j0.1/sync-s{seed}", 1.0, seed, 0.1, SYNC))
        fast = _rec(1.9, [[0, 3.0], [20, 2.2], [40, 1.8]])
        lines.append(_ledger_line(aj, f"scratch/j0.1/dn_dylu_time-s{seed}", 1.0, seed, 0.1, fast))
    lines.append(_ledger_line(aj, "scratch/j0.1/sync-s2", 1.0, 2, 0.1, SYNC))
    (tmp_path / "async_jitter_ledger.jsonl").write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, str(BENCH / "async_jitter.py"), "--report-only", "--out", str(tmp_path)]
    cmd += ["--figures", str(tmp_path / "fig"), "--seeds", "3", "--jitters", "0.1,0.2"]
    cmd += ["--scenarios", "scratch", "--methods", "dn_dylu_time"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{BENCH}"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=50)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "async_jitter.json").read_text())
    assert result["seeds_j0.1"] == [0, 1]
    assert result["j0.1"]["dn_dylu_time"]["vs_sync_pct_by_seed"] == [-5.0, -5.0]
    assert result["best_async_method_j0.1"] == "dn_dylu_time" and result["recommended_j0.1"] == "dn_dylu_time"
    assert "j0.2" not in result  # no run at all
    assert result["runs_missing"] == 1 + 6  # seed 2's dn_dylu_time; all of j0.2
    assert not result["targets"]["met"]
    assert not (tmp_path / "async_jitter_runs").exists()  # nothing ran
    assert result["warm_lr_probe"]["dn_dylu_time"]["best_vs_sync_best_pct"] == -5.0
    assert (tmp_path / "fig" / "async_jitter_j0.1.png").is_file()


@pytest.mark.timeout(30)
def test_the_warm_probe_table_compares_each_best_with_syncs_best_and_the_sweeps_lr(aj):
    lr_file = {
        "best_outer_lr": {"sync": 1.0, "dn_dylu_time": 0.7},
        "warm_probe": {
            "final_val_loss": {
                "sync": {"0.5": 2.2, "0.7": 2.1, "1": 2.0},
                "dn_dylu_time": {"0.5": 1.9, "0.7": 1.95, "1": 2.05},
            }
        },
    }
    table = aj.probe_table(lr_file)
    assert table["sync"] == {
        "best_outer_lr": 1.0,
        "best_val_loss": 2.0,
        "scratch_lr": 1.0,
        "val_loss_at_scratch_lr": 2.0,
        "best_vs_sync_best_pct": 0.0,
        "final_val_loss": {"0.5": 2.2, "0.7": 2.1, "1": 2.0},
    }
    dn = table["dn_dylu_time"]
    assert dn["best_outer_lr"] == 0.5 and dn["val_loss_at_scratch_lr"] == 1.95
    assert dn["best_vs_sync_best_pct"] == -5.0  # 1.9 against 2.0
    del lr_file["warm_probe"]["final_val_loss"]["sync"]
    assert aj.probe_table(lr_file) is None  # nothing to compare with


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra",
    [["--sweep", "--report-only"], ["--warm-probe", "--report-only"], ["--sweep", "--warm-probe"], []],
)
def test_bad_invocations_exit_2_with_one_sentence_and_write_nothing(aj, tmp_path, extra):
    """Two flags that exclude each other, or a report without the sweep's outer lrs."""
    cmd = [sys.executable, str(BENCH / "async_jitter.py"), "--out", str(tmp_path), *extra]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{BENCH}"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=50)
    assert done.returncode == 2
    assert ("give one of them" if extra else "run with --sweep first") in done.stderr
    assert not (tmp_path / "async_jitter.json").exists()
