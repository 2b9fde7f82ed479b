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
    assert "inner lr 0.016, warm-up 30 (on the widened grid's edge)" in warm
    assert "**0.016: 2.9725**" in warm  # warm-up 30's best, from the JSON's 2.97245839...
    assert "outer lr 0.7" in rows[list(arms).index("diloco k=4 H=10 warm")]


@pytest.mark.timeout(30)
def test_the_h500_table_has_data_parallel_and_each_H_with_its_gap_and_bytes():
    part = DATA["H500"]
    lines = _tables().h500(part).splitlines()
    assert len(lines) == 2 + 1 + len(part["by_H"])
    assert lines[2].startswith("| data parallel | 80 | inner lr 0.016, warm-up 30 | 3.0555 (2.9686–3.1423)")
    h10 = lines[3]
    assert h10.startswith("| DiLoCo H = 10 | 8 | outer lr 0.5 (0.36: 3.3639, **0.5: 3.3096**")
    assert "**+10.9%** (paired by seed +6.4% … +15.8%)" in h10 and h10.endswith("= 10.0× |")
    assert lines[4].startswith("| DiLoCo H = 20 | 4 | outer lr 0.7") and "= 20.0× |" in lines[4]
