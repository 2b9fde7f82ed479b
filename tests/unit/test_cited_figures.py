"""Figures the docs cite from a benchmark's JSON equal the JSON: every "`field` **value**
(results/FILE.json)" in docs/ is checked against benchmarks/results/FILE.json, at the precision
the doc gives (a field may be a path: `j0.1.sync.vs_sync_pct`, `wall_speedup_by_seed.2`), also
where a line break falls inside the citation."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"`([\w.\-]+)`\s+\*\*(-?[\d.]+)\*\*\s+\(results/([\w\-]+\.json)\)")


def _cited():
    for doc in sorted((ROOT / "docs").glob("*.md")):
        text = doc.read_text()
        for m in CITED.finditer(text):
            n = text.count("\n", 0, m.start()) + 1
            yield pytest.param(*m.groups(), id=f"{doc.name}:{n}:{m.group(1)}")


def _lookup(data, field):
    if isinstance(data, list):  # a list's item by its index: `wall_speedup_by_seed.2`
        index, _, rest = field.partition(".")
        return _lookup(data[int(index)], rest) if rest else data[int(index)]
    if field in data:
        return data[field]
    head, _, rest = field.partition(".")
    while rest and head not in data:  # keys with dots in them (j0.1): take the longest match
        more, _, rest = rest.partition(".")
        head = f"{head}.{more}"
    return _lookup(data[head], rest) if rest else data[head]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("field,value,name", list(_cited()))
def test_a_cited_figure_is_its_jsons(field, value, name):
    data = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    decimals = len(value.partition(".")[2])
    assert round(float(_lookup(data, field)), decimals) == float(value)


@pytest.mark.timeout(10)
def test_some_figures_are_cited():
    assert len(list(_cited())) >= 2
