"""benchmarks/bytes_to_loss.py: its plan reuses the reproduction's runs, its tuning (outer lr,
then the second setting at the targets' H, held at every other H) and bytes-to-target arithmetic
match hand computations on ledgers written here, and its command line refuses a bad H (exit 2,
nothing written). No run is started (the runs are the benchmark's job)."""

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
BENCH = ROOT / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there; bytes_to_loss imports rd
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def b2l():
    _load("reproduce_diloco")
    return _load("bytes_to_loss")


def _ctx(b2l, tmp_path: Path, hs=(10, 50)):
    args = argparse.Namespace(quick=False, hs=hs, jobs=1, workdir=tmp_path, ledger=tmp_path)
    return b2l.context(args)


@pytest.mark.timeout(60)
def test_plan_reuses_part_dp_runs_and_runs_the_targets_H_on_three_seeds(b2l, tmp_path):
    ctx = _ctx(b2l, tmp_path)
    tuned = b2l.plan(ctx, list(b2l.METHODS), (10, 50))
    assert list(tuned)[0] == ("fp32", 50)  # the targets' H first
    assert ("topk3_2bit_ef", 50) in tuned and ("topk3_2bit_ef", 10) not in tuned
    assert len(tuned) == 2 * len(b2l.METHODS) - 1
    # fp32 at H = 50 is the reproduction's warm k = 4 DiLoCo run (before issue 36's tuning
    # rules), by name: the ledger's results count (lr 1, seed 0 is a row of the committed ledger)
    names = [r.name for r in tuned["fp32", 50].grid_runs(ctx)]
    assert names == [ctx.diloco(0, k=4, lr=lr, warm=True).name for lr in (0.7, 1.0)]
    assert names[1] == "diloco-k4-H50-s0-b96fc9acd6b4"
    # until the targets' H has picked its second setting, another H runs nothing of its own
    assert [r.name for r in tuned["fp32", 10].grid_runs(ctx)] == names
    assert tuned["fp32", 10].runs(ctx) == [] and tuned["fp32", 10].table(ctx) == {}
    assert tuned["fp32", 50].seeds == [0, 1, 2] and tuned["fp32", 10].seeds == [0, 1]
    parts = b2l.parts([], tuned)  # the scheduler's parts: the targets' H before every other H
    assert list(parts) == ["dp", "H=50", "H=10"] and parts["H=50"].tuned[0] is tuned["fp32", 50]
    assert len(parts["H=50"].tuned) == len(b2l.METHODS) and len(parts["H=10"].tuned) == len(b2l.METHODS) - 1
    flags = tuned["sparseloco3", 10].make(2.0, None, 0).flags
    assert flags[flags.index("--outer-opt") + 1] == "sparseloco"
    assert flags[flags.index("--topk-fraction") + 1] == "0.03"
    assert "--ef-decay" not in flags  # the default (0.95) is not passed: the ledger's runs count
    assert "--init-from" not in flags and tuned["sparseloco3", 10].make(2.0, None, 0).init is not None
    beta = tuned["sparseloco3", 10].make(2.0, 0.8, 0)
    assert beta.flags[beta.flags.index("--ef-decay") + 1] == "0.8" and "β=0.8" in beta.label
    momentum = tuned["fp32", 50].make(1.0, 0.8, 0).flags
    assert momentum[momentum.index("--outer-momentum") + 1] == "0.8"
    assert "--outer-momentum" not in tuned["fp32", 50].make(1.0, None, 0).flags


def _row(run, val_loss: float, bytes_per_worker: int, curve: list) -> dict:
    return {
        "name": run.name,
        "label": run.label,
        "flags": list(run.flags),
        "init": run.init.name if run.init else None,
        "summary": {
            "val_loss": val_loss,
            "final_subset_val_loss": val_loss + 0.01,  # the fixed subset's, what curves are read against
            "bytes_sent_per_worker": bytes_per_worker,
            "inner_steps": 4000,
        },
        "curve": curve,
        "elapsed_s": 1.0,
        "recorded": "2026-12-04T00:00:00",
    }


def _write(tmp_path: Path, rows: list[dict]) -> None:
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _dp_rows(ctx) -> list[dict]:
    """Data parallel ends at 2.0 (seed 0), 2.1 (1), 2.2 (2), having sent 1,000,000 bytes a worker."""
    return [_row(ctx.dp(4, s, warm=True), v, 1_000_000, []) for s, v in enumerate((2.0, 2.1, 2.2))]


@pytest.mark.timeout(60)
def test_a_best_lr_on_the_grid_edge_widens_the_grid(b2l, tmp_path):
    ctx = _ctx(b2l, tmp_path, hs=(50,))
    t = b2l.plan(ctx, ["sparseloco3"], (50,))["sparseloco3", 50]
    _write(
        tmp_path,
        _dp_rows(ctx) + [_row(t.make(lr, None, 0), v, 5000, []) for lr, v in ((2.0, 2.5), (4.0, 1.9))],
    )
    ctx = _ctx(b2l, tmp_path, hs=(50,))  # reads the ledger
    p = b2l.report(ctx, b2l.plan(ctx, ["sparseloco3"], (50,)))["points"]["sparseloco3 H=50"]
    assert p["lr_grid_seed0"] == {"2": 2.5, "4": 1.9, "5.6": None}  # 4 on the edge: 5.6 next
    assert p["outer_lr"] is None and p["val_loss"] is None  # no pick until the grid has run
    assert p["second"]["grid_seed0"] == {} and p["second"]["pick"] is None  # nor a β grid


@pytest.mark.timeout(60)
def test_the_lr_grid_widens_four_times_then_reports_its_edge(b2l, tmp_path):
    """Seed 0's loss falls with the lr all the way: 2, 4, then 5.6, 7.8, 11, 15 (four widenings,
    reproduce_diloco's grids stop at two), and no fifth; the best (15) is then on the edge."""
    assert b2l.LR_WIDEN == 4
    ctx = _ctx(b2l, tmp_path, hs=(50,))
    t = b2l.plan(ctx, ["sparseloco3"], (50,))["sparseloco3", 50]
    lrs = {2.0: 2.5, 4.0: 2.4, 5.6: 2.3, 7.8: 2.2, 11.0: 2.1, 15.0: 2.0, 21.0: 1.9}
    _write(tmp_path, _dp_rows(ctx) + [_row(t.make(lr, None, 0), v, 5000, []) for lr, v in lrs.items()])
    ctx = _ctx(b2l, tmp_path, hs=(50,))
    first = b2l.plan(ctx, ["sparseloco3"], (50,))["sparseloco3", 50]._first()
    assert first.grid(ctx) == (2.0, 4.0, 5.6, 7.8, 11.0, 15.0)  # 21 is in the ledger, not the grid
    assert first.best(ctx) == 15.0 and first.at_edge(ctx) is True


def _choice_rows(t, lrs: dict, betas: dict) -> list[dict]:
    """Seed 0's rows of the targets' H: the lr grid at the default β, then β at its best lr (4)."""
    rows = [_row(t.make(lr, None, 0), v, 5000, []) for lr, v in lrs.items()]
    return rows + [_row(t.make(4.0, b, 0), v, 5000, []) for b, v in betas.items()]


@pytest.mark.timeout(60)
def test_the_second_setting_is_tuned_at_the_targets_H_then_held(b2l, tmp_path):
    """SparseLoCo 3%, H = 50, seed 0: lr 2 → 2.5, 4 → 1.9, 5.6 → 2.3 at β = 0.95 (the default):
    lr 4. At lr 4: β 0.8 → 1.85, 0.9 → 1.88, 0.95 → 1.9 (the lr grid's run): 0.8 on the edge,
    so 0.6 (1 − β doubled) → 1.87: β 0.8. Then the lr again at β 0.8: 2.9 → 1.95, 4 → 1.85 (the
    β grid's run), 5.6 → 1.9: lr 4, run on 3 seeds; H = 100 tunes its lr at β 0.8."""
    ctx = _ctx(b2l, tmp_path, hs=(50, 100))
    t = b2l.plan(ctx, ["sparseloco3"], (50, 100))["sparseloco3", 50]
    rows = _choice_rows(t, {2.0: 2.5, 4.0: 1.9, 5.6: 2.3}, {0.8: 1.85, 0.9: 1.88})
    _write(tmp_path, _dp_rows(ctx) + rows)
    ctx = _ctx(b2l, tmp_path, hs=(50, 100))
    assert b2l.plan(ctx, ["sparseloco3"], (50, 100))["sparseloco3", 50].second_grid(ctx) == (
        0.6,
        0.8,
        0.9,
        0.95,
    )
    rows += [_row(t.make(4.0, 0.6, 0), 1.87, 5000, [])]
    _write(tmp_path, _dp_rows(ctx) + rows)
    ctx = _ctx(b2l, tmp_path, hs=(50, 100))
    at100 = b2l.plan(ctx, ["sparseloco3"], (50, 100))["sparseloco3", 100]
    # β is picked but H = 50's lr is not yet re-tuned at it: H = 100 waits, running H = 50's runs
    assert at100.second(ctx) == 0.8 and at100.tuned(ctx) is None and at100.runs(ctx) == []
    assert {t.make(lr, 0.8, 0).name for lr in (2.9, 5.6)} <= {r.name for r in at100.grid_runs(ctx)}
    rows += [_row(t.make(lr, 0.8, 0), v, 5000, []) for lr, v in ((2.9, 1.95), (5.6, 1.9))]
    _write(tmp_path, _dp_rows(ctx) + rows)
    ctx = _ctx(b2l, tmp_path, hs=(50, 100))
    tuned = b2l.plan(ctx, ["sparseloco3"], (50, 100))
    at50, at100 = tuned["sparseloco3", 50], tuned["sparseloco3", 100]
    assert at50.second(ctx) == 0.8 and at100.second(ctx) == 0.8
    p = b2l.report(ctx, tuned)["points"]["sparseloco3 H=50"]
    assert p["second"] == {
        "setting": "ef-decay",
        "default": 0.95,
        "grid": [0.6, 0.8, 0.9, 0.95],
        "grid_seed0": {"0.6": 1.87, "0.8": 1.85, "0.9": 1.88, "0.95": 1.9},
        "pick": 0.8,
        "lr_grid_seed0_at_default": {"2": 2.5, "4": 1.9, "5.6": 2.3},
    }
    assert p["lr_grid_seed0"] == {"2.9": 1.95, "4": 1.85, "5.6": 1.9} and p["outer_lr"] == 4.0
    picks = at50.runs(ctx)
    assert [r.seed for r in picks] == [0, 1, 2] and picks[0].name == t.make(4.0, 0.8, 0).name
    assert all(r.flags[r.flags.index("--ef-decay") + 1] == "0.8" for r in picks)
    grid100 = [r for r in at100.grid_runs(ctx) if "-H100-" in r.name]  # around H = 50's lr pick
    assert [r.flags[r.flags.index("--outer-lr") + 1] for r in grid100] == ["2.9", "4", "5.6"]
    assert all(r.flags[r.flags.index("--ef-decay") + 1] == "0.8" for r in grid100)


@pytest.mark.timeout(150)
def test_bytes_to_target_by_hand(b2l, tmp_path):
    """SparseLoCo 3% at H = 100 sends 5,000 bytes a worker in 10 rounds: 500 a round. Its grid on
    seed 0, H = 50's pick (4) and its neighbours in H = 50's grid, is 2 → 2.5, 4 → 1.9, 5.6 → 2.3
    (no widening: 4 is inside). Data parallel's final
    subset losses are 2.01 (seed 0) and 2.11 (seed 1). Seed 0 first reaches 2.01 at step 300 (3
    rounds, 1,500 bytes: ratio 0.0015; 2.05 at step 200 is above it); seed 1 reaches 2.11 at step
    700 (3,500 bytes: 0.0035). The point's ratio is the larger, 1/286."""
    ctx = _ctx(b2l, tmp_path, hs=(100,))
    plan = b2l.plan(ctx, ["sparseloco3"], (100,))
    t = plan["sparseloco3", 100]
    # the targets' H (50) keeps the default β: 0.8 → 2.0, 0.9 → 1.95, 0.95 → 1.9 (its lr grid's
    # run), 0.975 (the widening past 0.95) → 1.96
    at50 = plan["sparseloco3", 100].target
    choice = _choice_rows(at50, {2.0: 2.5, 4.0: 1.9, 5.6: 2.3}, {0.8: 2.0, 0.9: 1.95, 0.975: 1.96})
    rows = (
        _dp_rows(ctx)
        + choice
        + [
            _row(t.make(2.0, None, 0), 2.5, 5000, [[0, 3.0], [1000, 2.5]]),
            _row(t.make(5.6, None, 0), 2.3, 5000, [[0, 3.0], [1000, 2.3]]),
            _row(
                t.make(4.0, None, 0), 1.9, 5000, [[0, 3.0], [100, 2.5], [200, 2.05], [300, 1.99], [1000, 1.9]]
            ),
            _row(t.make(4.0, None, 1), 2.0, 5000, [[0, 3.0], [600, 2.2], [700, 2.105], [1000, 2.0]]),
        ]
    )
    _write(tmp_path, rows)
    ctx = _ctx(b2l, tmp_path, hs=(100,))
    result = b2l.report(ctx, b2l.plan(ctx, ["sparseloco3"], (100,)))
    p = result["points"]["sparseloco3 H=100"]
    assert p["outer_lr"] == 4.0 and p["outer_lr_at_grid_edge"] is False
    assert p["per_seed"] == {"0": 1.9, "1": 2.0}
    assert p["bytes_ratio_by_seed"] == {"0": 0.0015, "1": 0.0035}
    assert p["reached"] is True and p["bytes_ratio"] == 0.0035
    assert result["best_run"] == "sparseloco3 H=100" and result["best_bytes_ratio_inverse"] == 286
    assert result["dp_final_val_loss"] == pytest.approx(2.1)
    assert result["frontier"] == ["sparseloco3 H=100"]
    # the command line gives the same report; with --out its figure goes beside the JSON. Lr 5.6's
    # row is now only a finished folder (a run made outside the scheduler): it enters the ledger
    lr56 = t.make(5.6, None, 0)
    _write(tmp_path, [r for r in rows if r["name"] != lr56.name])
    (tmp_path / lr56.name).mkdir()
    (tmp_path / lr56.name / "model.safetensors").write_bytes(b"")
    summary = {"val_loss": 2.3, "final_subset_val_loss": 2.31, "bytes_sent_per_worker": 5000}
    (tmp_path / lr56.name / "summary.json").write_text(json.dumps(summary))
    evals = [
        {"kind": "eval", "inner_step": i, "split": "subset", "val_loss": v}
        for i, v in ((0, 3.0), (1000, 2.3))
    ]
    (tmp_path / lr56.name / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    where = ["--workdir", str(tmp_path), "--ledger", str(tmp_path), "--out", str(tmp_path / "o.json")]
    ok = subprocess.run(
        [sys.executable, str(BENCH / "bytes_to_loss.py"), "--report-only", "--hs", "100",
         "--methods", "sparseloco3", *where],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=100,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["best_bytes_ratio"] == 0.0035 and out["figure"] == str(tmp_path / "o.png")
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"
    kept = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    row = next(r for r in kept if r["name"] == lr56.name)
    assert row["summary"]["val_loss"] == 2.3 and row["curve"] == [[0, 3.0], [1000, 2.3]]
    assert len(kept) == len(rows)


@pytest.mark.timeout(30)
def test_frontier_keeps_points_nothing_beats(b2l):
    def pt(name, H, loss, b):
        return {"method": name, "H": H, "val_loss": {"mean": loss}, "bytes_sent_per_worker": b}

    points = [pt("a", 10, 2.0, 1000), pt("b", 50, 2.1, 100), pt("c", 50, 2.2, 200), pt("d", 500, 2.5, 10)]
    assert b2l.frontier(points) == ["d H=500", "b H=50", "a H=10"]  # c: b is cheaper and better
    assert b2l.to_target([0, 50, 100], [3.0, 2.0, 1.0], 2.0) == 50
    assert b2l.to_target([0, 50], [3.0, 2.5], 2.0) is None


@pytest.mark.timeout(120)
def test_cli_report_only_and_bad_H(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    where = ["--workdir", str(tmp_path / "runs"), "--ledger", str(tmp_path / "ledger")]
    where += ["--out", str(tmp_path / "o.json")]
    bad = subprocess.run(
        [sys.executable, str(BENCH / "bytes_to_loss.py"), "--hs", "7", *where],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "every H must divide the 1000 steps" in bad.stderr
    assert list(tmp_path.iterdir()) == []
    ok = subprocess.run(
        [sys.executable, str(BENCH / "bytes_to_loss.py"), "--report-only", "--hs", "50", *where],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    out = json.loads((tmp_path / "o.json").read_text())
    assert set(out["points"]) == {f"{m} H=50" for m in ("fp32", "fp4_ef", "topk10_ef", "topk3_2bit_ef")} | {
        f"sparseloco{d} H=50" for d in (1, 3, 10)
    }
    assert out["best_bytes_ratio"] is None and out["figure"] is None  # nothing has run
