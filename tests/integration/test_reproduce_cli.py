"""benchmarks/reproduce_diloco.py's command line, run for real: bad part-H settings exit 2 before
anything is written, and `--h-k` plans part H alone at that k. `--report-only` on an empty
workdir starts no run, so this takes seconds (the runs themselves are the benchmark's job)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "reproduce_diloco.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    where = ["--workdir", str(tmp_path / "runs"), "--ledger", str(tmp_path / "ledger")]
    where += ["--out", str(tmp_path / "out.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, *where],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--part", "H", "--h-k", "0"], "--h-k must be ≥ 1"),
        (["--part", "dp", "--h-k", "8"], "give --part H alone"),
        (["--part", "H", "--hs", "7"], "multiples of every H"),  # 1,000 steps are not 7s
        (["--part", "H", "--hs", "0"], "each ≥ 1"),
    ],
)
def test_bad_part_H_settings_exit_2_and_write_nothing(tmp_path, args, message):
    p = _run(tmp_path, "--report-only", *args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_h_k_plans_part_H_alone_at_that_k(tmp_path):
    p = _run(tmp_path, "--report-only", "--part", "H", "--h-k", "8", "--hs", "10")
    assert p.returncode == 0, p.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    parts = {"dp", "single", "workers", "H", "outer", "shards", "drop", "schedule", "codec"}
    assert parts & set(out) == {"H"}  # the other parts stay the default JSON's
    # H = 10 and the baseline H = 50, and data parallel at k = 8: 3 seeds each, none run yet
    assert out["H"] == {"status": "not run", "runs_planned": 9}
    default = _run(tmp_path, "--report-only", "--part", "H", "--hs", "10")
    assert default.returncode == 0, default.stderr
    assert parts <= set(json.loads((tmp_path / "out.json").read_text()))


def _module():
    spec = importlib.util.spec_from_file_location("reproduce_diloco", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
@pytest.mark.parametrize("h_k", [4, 8])
def test_part_H_runs_diloco_and_data_parallel_at_h_k(tmp_path, h_k):
    mod = _module()
    args = argparse.Namespace(
        quick=False, ks=(4, 8), starts=("scratch",), lr_grid=(0.7,), serial_ks=(), model="nano",
        steps=1000, H=50, hs=(10, 50), h_k=h_k, seeds=2, pretrain_steps=1000, jobs=1,
        workdir=tmp_path, ledger=tmp_path / "runs.jsonl",
    )  # fmt: skip
    ctx = mod.Ctx(args)
    plan, _ = mod.part_H(ctx)
    runs = plan.all_runs(ctx)
    assert len(runs) == 6  # (H = 10, H = 50, data parallel) × 2 seeds, each once
    for r in runs:
        flags = list(r.flags)
        assert flags[flags.index("--workers") + 1] == str(h_k), r.label
    assert sorted(r.label for r in runs if "--method" in r.flags and "dp" in r.flags) == [
        f"dp k={h_k} s0",
        f"dp k={h_k} s1",
    ]
