"""benchmarks/doc_tables.py's tables for issue 36's JSON, rendered from a real one: the fixture is
`reproduce_diloco.py --quick --seeds 2 --part dp,drop,H500` (a tiny model; its dp and H500 parts,
tests/fixtures/reproduce_quick_issue36.json), so the tables are ready when the lane's JSON lands."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "tests" / "fixtures" / "reproduce_quick_issue36.json").read_text())


def _tables():
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "benchmarks" / "doc_tables.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(30)
def test_the_tuning_table_has_every_arm_its_grid_and_its_pick_in_bold():
    text = _tables().tuning(DATA)
    rows = text.splitlines()[2:]
    arms = DATA["dp"]["tuning"]["arms"]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == list(arms)
    for row, r in zip(rows, arms.values(), strict=True):
        assert row.count("**") == 2, row  # one pick, in bold
        assert f"**{r.get('lr', r.get('pick')):g}: " in row, row  # the picked lr's cell
    warm = rows[list(arms).index("dp k=4 warm")]
    assert warm.endswith("| inner lr 0.016, warm-up 30 |")  # inside its grid: 0.032 was worse
    assert "**0.016: 2.9691**" in warm  # warm-up 30's best, from the JSON's 2.96912988...
    diloco = rows[list(arms).index("diloco k=4 H=10 warm")]
    assert "at inner lr 0.008, warm-up 30: " in diloco  # single's pick (its warm row)
    assert diloco.endswith("| outer lr 1 |")


@pytest.mark.timeout(30)
def test_the_tuning_table_lists_an_earlier_rule_runs_as_an_ablation_not_a_pick():
    data = json.loads(json.dumps(DATA))
    data["dp"]["tuning"]["ablations"] = {"diloco k=4 H=10 warm, inner lr 1e-3 wu 30": {"0.7": 3.61, "1": 3.5}}
    last = _tables().tuning(data).splitlines()[-1]
    assert (
        last == "| ablation: diloco k=4 H=10 warm, inner lr 1e-3 wu 30 | 0.7: 3.6100, 1: 3.5000 | not used |"
    )


@pytest.mark.timeout(30)
def test_the_h500_table_has_data_parallel_single_and_each_H_with_its_gap_and_bytes():
    part = DATA["H500"]
    lines = _tables().h500(part).splitlines()
    assert len(lines) == 2 + 2 + len(part["by_H"])
    assert lines[2].startswith("| data parallel | 80 | inner lr 0.016, warm-up 30 | 3.0535 (2.9684–3.1387)")
    single = "| single (tuning grid only: DiLoCo's inner settings) | — | inner lr 0.008, warm-up 30 |"
    assert lines[3] == single + " — | — | — |"  # its re-tuned pick, from the JSON's single_tuning
    h10 = lines[4]
    assert h10.startswith("| DiLoCo H = 10 | 8 | outer lr 0.71 (0.51: 3.0236, **0.71: 3.0094**")
    assert "inner lr 0.008, warm-up 30 (single's at these steps)" in h10
    assert "**+6.4%** (paired by seed +1.0% … +12.2%)" in h10 and h10.endswith("= 10.0× |")
    assert lines[5].startswith("| DiLoCo H = 20 | 4 | outer lr 0.36") and "= 20.0× |" in lines[5]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("start", ["warm", "scratch"])
def test_the_dp_tables_show_each_start_with_every_arm_tuned_pick(start):
    """Part dp's table per start: its losses from the JSON, and a row of each k's picks."""
    text = getattr(_tables(), f"dp_{start}")(DATA)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()}
    k4 = DATA["dp"]["per_k"]["4"][start]
    dp = k4["dp"]["val_loss"]
    assert rows["data parallel (k× batch, 40 steps)"].split(" | ")[1].startswith(f"{dp['mean']:.4f}")
    picks = rows["picked on the tuning seed and split"].split(" | ")[1]
    assert f"data parallel: inner lr {k4['dp']['lr']:g}, warm-up {k4['dp']['pick'].split()[-1]}" in picks
    for k, cell in zip(("4", "8"), rows["picked on the tuning seed and split"].split(" | ")[1:], strict=True):
        lr = DATA["dp"]["per_k"][k][start]["diloco"]["outer_lr"]
        assert cell.rstrip(" |").endswith(f"DiLoCo: outer lr {lr:g} at single's inner lr"), cell
    assert (start == "warm") == any(r.startswith("serial") for r in rows)


@pytest.mark.timeout(30)
def test_the_dp_table_of_a_lane_still_tuning_says_not_run_and_tuning():
    """The report runs with partial ledgers: arms without runs (DiLoCo waiting for single's
    pick, its entry without bytes) render as "not run" and "tuning", not an error."""
    data = json.loads(json.dumps(DATA))
    for k in ("4", "8"):
        row = data["dp"]["per_k"][k]["warm"]
        row["diloco"], row["diloco_outer_lr"] = {"val_loss": None, "vs_dp": None}, None
        row["dp"] = {"val_loss": None, "grids": {}, "pick": None, "lr": None}
    data["dp"]["pretrain"] = {"val_loss": None}
    lines = _tables().dp_warm(data).splitlines()
    assert lines[0].startswith("| run (warm start from the 40-step") and "val_loss" not in lines[0]
    assert "| **DiLoCo** (H = 10, Nesterov, best outer lr tuning) | **not run** | **not run** |" in lines
    assert "| bytes sent per worker, data parallel / DiLoCo | not run | not run |" in lines
    assert lines[-1].count("DiLoCo: tuning") == 2 and lines[-1].count("data parallel: tuning") == 2
