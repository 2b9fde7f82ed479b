"""Every measured number in docs/results.md and docs/reproduction.md is its JSON's (issue 36).

A number with four or more decimals outside code blocks (a loss, a ratio) must be, within half a
unit of its last decimal, a value of a JSON file the doc names (benchmarks/results/…, a ledger),
or 100 × one (a percentage). Curves are left out of the values: the docs cite final values, and
a curve's hundreds of points would let a wrong number match by chance. The few numbers that come
from no benchmark's JSON (a command run by hand, a value quoted from a paper) are listed in
EXEMPT with the reason; an exemption that no longer matches a number fails too, so the list
cannot go stale. Cited figures in the "`field` **value** (results/FILE.json)" form are checked
field by field in test_cited_figures.py.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("results.md", "reproduction.md")
NUMBER = re.compile(r"(?<![\w.])([−+-]?\d+\.\d{4,})(?!\d)")
CITED = re.compile(r"([\w\-]+(?:/[\w\-]+)*\.jsonl?)\b")
SKIP_KEYS = {"curve", "dp_curve", "curves", "events", "trace"}
# (doc, number as written) -> why it comes from no benchmark's JSON
ISSUE_2 = "issue 2's table of `diloco train --method M` run by hand (docs/results.md's first section)"
EXEMPT: dict[tuple[str, str], str] = {
    ("results.md", "2.4902"): ISSUE_2 + "; `diloco train` with defaults, quoted again later",
    ("results.md", "2.4271"): ISSUE_2,
    ("results.md", "2.4934"): ISSUE_2,
    ("results.md", "2.4880"): ISSUE_2 + ", its first cut",
    ("results.md", "2.4258"): ISSUE_2 + ", its first cut",
    ("results.md", "2.4966"): ISSUE_2 + ", its first cut",
    ("results.md", "2.616281076262269"): "a `diloco train --method async --dylu` run by hand",
    ("results.md", "2.1862"): "the outer-lr ablation at H = 250, `diloco train` run by hand",
    ("results.md", "2.2102"): "the outer-lr ablation at H = 250, `diloco train` run by hand",
    (
        "results.md",
        "2.4531",
    ): "the warm start's own val_loss (its run folder); async_vs_sync.py does not save it",
    (
        "reproduction.md",
        "2.0985",
    ): "seed 1 of the first kmeans attempt, made by an earlier diloco and since replaced",
    ("reproduction.md", "2.1054"): "a mean of two constant runs' means in the doc, computed by hand",
    ("reproduction.md", "2.0880"): "a mean of two constant runs' means in the doc, computed by hand",
}


def _values(x, out: list[float]) -> list[float]:
    if isinstance(x, bool):
        return out
    if isinstance(x, (int, float)) and math.isfinite(x):
        out.append(float(x))
    elif isinstance(x, dict):
        for k, v in x.items():
            if k not in SKIP_KEYS:
                _values(v, out)
    elif isinstance(x, list):
        for v in x:
            _values(v, out)
    return out


@cache
def _file_values(name: str) -> tuple[float, ...]:
    """The numbers of benchmarks/results/<name> (a JSON file, or JSON lines); () if none."""
    hits = [RESULTS / name] if (RESULTS / name).is_file() else list(RESULTS.rglob(Path(name).name))
    out: list[float] = []
    for path in hits:
        text = path.read_text()
        rows = (
            [json.loads(line) for line in text.splitlines() if line.strip()]
            if path.suffix == ".jsonl"
            else [json.loads(text)]
        )
        for row in rows:
            _values(row, out)
    return tuple(out)


def _numbers():
    for doc in DOCS:
        text = (ROOT / "docs" / doc).read_text()
        files = tuple(sorted({m.group(1) for m in CITED.finditer(text)}))
        prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
        for m in NUMBER.finditer(prose):
            line = prose.count("\n", 0, m.start()) + 1
            yield pytest.param(doc, m.group(1), files, id=f"{doc}:{line}:{m.group(1)}")


def _matches(written: str, files: tuple[str, ...]) -> bool:
    x = float(written.replace("−", "-"))
    tol = 0.5 * 10 ** -len(written.partition(".")[2]) + 1e-12
    return any(abs(v - x) <= tol or abs(100 * v - x) <= tol for f in files for v in _file_values(f))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("doc,written,files", list(_numbers()))
def test_a_measured_number_is_in_a_json_its_doc_cites(doc, written, files):
    if (doc, written) in EXEMPT:
        pytest.skip(EXEMPT[(doc, written)])
    assert files, f"{doc} cites no JSON file"
    assert _matches(written, files), f"{written} is in none of {', '.join(files)}"


@pytest.mark.timeout(60)
def test_every_exemption_is_still_in_its_doc_and_still_needed():
    for (doc, written), why in EXEMPT.items():
        text = (ROOT / "docs" / doc).read_text()
        assert written in text, f"{doc} no longer says {written} ({why}): drop the exemption"


@pytest.mark.timeout(60)
def test_the_check_can_fail():
    """A loss one unit off in its last decimal, and a made-up ratio, match nothing cited."""
    assert _matches("1.7008", ("reproduce_diloco_2026-12-01.json",))
    assert not _matches("1.7018", ("reproduce_diloco_2026-12-01.json",))
    assert len(list(_numbers())) > 300


def _doc_tables():
    import importlib.util

    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "benchmarks" / "doc_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_a_generated_table_is_what_its_json_gives(doc):
    """Tables between `<!-- table: NAME results/FILE.json -->` markers are made from the JSON by
    benchmarks/doc_tables.py; rerun it after a benchmark (`python benchmarks/doc_tables.py`)."""
    text = (ROOT / "docs" / doc).read_text()
    assert _doc_tables().render(text) == text, f"{doc}: run python benchmarks/doc_tables.py"


@pytest.mark.timeout(60)
def test_a_changed_figure_in_a_generated_table_is_caught():
    tables = _doc_tables()
    text = (ROOT / "docs" / "reproduction.md").read_text()
    assert text.count("<!-- table: ") >= 15
    wrong = text.replace(
        "| **DiLoCo** (H = 50, Nesterov, best outer lr 1.0) | **1.7008",
        "| **DiLoCo** (H = 50, Nesterov, best outer lr 1.0) | **1.7018",
    )
    assert wrong != text and tables.render(wrong) == text
    assert tables._pct(0.01775) == "+1.78%" and tables._pct(-2e-05, 3) == "−0.002%"
