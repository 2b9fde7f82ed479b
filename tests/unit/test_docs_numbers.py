"""Every measured number in docs/ is its JSON's (issue 36: results.md and reproduction.md; since
then every page).

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
from conftest import benchmark_module

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = tuple(sorted(p.name for p in (ROOT / "docs").glob("*.md")))
NUMBER = re.compile(r"(?<![\w.])(?<!arXiv )([−+-]?\d+\.\d{4,})(?!\d)")  # not a paper's arXiv id
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


def _values(x, out: list[float], floats: bool = False, keys: bool = False) -> list[float]:
    if isinstance(x, bool):
        return out
    if isinstance(x, (float, int) if not floats else float) and math.isfinite(x):
        out.append(float(x))
    elif isinstance(x, dict):
        for k, v in x.items():
            if k not in SKIP_KEYS:
                if keys and re.fullmatch(r"\d+\.\d+", k):  # a grid's setting, filed as a key
                    out.append(float(k))
                _values(v, out, floats, keys)
    elif isinstance(x, list):
        for v in x:
            _values(v, out, floats, keys)
    return out


@cache
def _file_values(name: str, floats: bool = False, keys: bool = False) -> tuple[float, ...]:
    """The numbers of benchmarks/results/<name> (a JSON file, or JSON lines); () if none. With
    `floats`, only those JSON writes as floats: not its integers (settings, counts, steps). With
    `keys`, also the keys that are decimal numbers: a grid's settings ("0.71": its result)."""
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
            _values(row, out, floats, keys)
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
    return benchmark_module("doc_tables")


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


# -- numbers with a unit: a percentage, a ratio, a time, a size, a rate ---------------------------
# A number of 1–3 decimals followed by one of these units, in prose or a hand-written table (the
# generated tables are checked above), must be a value of a JSON file cited in its own section
# (## or ###), at the precision written, in one of the unit's scales (a percentage: 100 × a
# fraction, or a percentage; a time in ms: ms or s; ...), the first number of a range or a
# change (4.3–5.0%, 3.9 → 2.5 s) in the second's unit. Its sign is not checked (the docs write a
# negative gap as "2.9% below"). Fewer decimals match more values by chance, so this catches a
# number no cited file holds (a file overwritten since, or a number never saved), not every
# wrong digit. Numbers derived in the text from the section's figures, a benchmark's settings,
# or history kept only in git are listed in UNIT_EXEMPT by a fragment of their line, with the
# reason.
UNIT = re.compile(r"(?<![\w.])([−+-]?\d+\.\d{1,3})(?!\d)(\s?(?:%|×)| ?ms\b| s\b| ?MB\b| ?GB\b| pushes/s\b)")
# a whole number of percent or times (12%, 50×; not a product such as 16 × 128) on the pages of
# results (the other pages' are settings and the papers' numbers), checked the same way: within
# half a percent it, too, catches a number no cited file holds rather than every wrong digit
WHOLE_DOCS = ("results.md", "reproduction.md")
WHOLE = re.compile(r"(?<![\w.,])([−+-]?\d+)(?![\d.,]\d)(\s?(?:%|×))(?!\s?\d)")
# on the same pages, a number of two or three decimals without a unit (a loss, a ratio: 1.84,
# 0.915), at scale 1; not a threshold (≥ 0.95) and not one with a unit the patterns above leave
# out (2.46M, 2.61 Mbit/s, 4e-3)
PLAIN = re.compile(
    r"(?<![\w.])(?<![≥≤<>] )(?<![≥≤<>])([−+-]?\d+\.\d{2,3})(?![\d])(?!\.\d)"  # not a version
    r"(?!\s?(?:%|×|ms\b|s\b|MB\b|GB\b|pushes/s\b|[eE][−+-]?\d|M\b|B\b|k\b|Mbit/s|Gbit/s))"
)
# on the same pages, a number with thousands separators and a measured unit, or alone in a table
# cell (21,739 tokens/s, 1,938 MB, | 36,899 |); not a count of steps, tokens or rounds (settings)
GROUPED = re.compile(
    r"(?<![\w.,])(\d{1,3}(?:,\d{3})+(?:\.\d+)?)(?![\d,]\d)(\s?(?:MB\b|GB\b|ms\b|s\b|tokens/s\b)|(?=\s*\|))"
)
# the first number of a range or a change, whose unit is the second's: 4.3–5.0%, 3.9 → 2.5 s
RANGE = re.compile(
    r"(?<![\w.])([−+-]?\d+\.\d{1,3})\s?(?:–|→)\s?"
    r"(?=[−+-]?\d+\.\d{1,3}(\s?(?:%|×)| ?ms\b| s\b| ?MB\b| ?GB\b| pushes/s\b))"
)
SCALES = {
    "%": (100.0, 1.0),
    "×": (1.0,),
    "ms": (1.0, 1000.0),
    "s": (1.0, 0.001),
    "MB": (1.0, 1e-6, 1 / 2**20, 1000.0),
    "GB": (1.0, 1e-9, 1 / 2**30, 0.001, 1 / 1024),
    "pushes/s": (1.0,),
    "": (1.0,),
    "tokens/s": (1.0,),
}
DERIVED = "derived in the text from the figures of the table or sentence before it"
HISTORY = "an earlier run in this section's history, kept in git only (the log of its commit)"
SETTINGS = "the benchmark's settings (each worker's simulated seconds per step), not a result"
NOT_RUN = "the size of the push files a row not run would write (pushes × message size)"
SERVER_HISTORY = "server_capacity.json as an earlier commit wrote it (git log -p on the file)"
UNIT_EXEMPT: dict[tuple[str, str], str] = {
    ("results.md", "give 1.7× the tokens/s"): DERIVED + " (36,899 / 21,739 tokens/s)",
    ("results.md", "| 2.46M | 11.6 MB |"): ISSUE_2,
    ("results.md", "| 2.46M | 581.3 MB |"): ISSUE_2,
    ("results.md", "0.58 / 0.75 / 1.51 / 3.33 s per step"): SETTINGS,
    ("results.md", "0.58/0.75/1.51/3.33 s/step"): SETTINGS,
    ("results.md", "async ends 4.3–5.0% below"): DERIVED + " (1 − the table's loss ratios)",
    ("results.md", "ends 5.1–6.0% below"): DERIVED + " (1 − the table's loss ratios)",
    ("results.md", "push files (21.7 GB)"): NOT_RUN,
    ("results.md", "push files (22.2 GB)"): NOT_RUN,
    ("results.md", "push files (88.7 GB)"): NOT_RUN,
    ("results.md", "push files (11.4 GB)"): NOT_RUN,
    ("results.md", "(median about 1.15×"): DERIVED + " (the table's tmpfs rows over its disk rows)",
    ("results.md", "0.435 → 0.641 pushes/s"): SERVER_HISTORY + " (1dac1ca, d084047)",
    ("results.md", "at 5.4 and 6.8 pushes/s"): "an A/B run by hand, one run each, not saved as JSON",
    ("results.md", "first) at 0.658 pushes/s"): SERVER_HISTORY + " (e8cbb93)",
    ("results.md", "2.47 GB in the main heap"): "a snapshot of the server's memory map, by hand",
    ("results.md", "measured 2771.7 MB over an idle"): SERVER_HISTORY + " (d084047)",
    ("results.md", "against 4.6 GB in the run before"): "a run's peak RSS that no JSON kept",
    ("results.md", "peaked at 2.44 GB"): SERVER_HISTORY + " (9ce33a2)",
    ("results.md", "from 1.95 to 4.19 pushes/s"): SERVER_HISTORY + " (before and at e7d8f3d)",
    ("results.md", "600.95 s simulated"): "a `diloco train --method async --dylu` run by hand",
    (
        "results.md",
        "grace `auto` = 2.9 s here",
    ): "what `--grace-s auto` works out to at these speeds (not saved)",
    ("results.md", "dn_dylu ≤ 1.01 × sync"): "the issue's target, not a result",
    ("results.md", "differ by 0.9% on the mean"): DERIVED + " (`jitter_per_seed`'s losses)",
    ("results.md", "per seed by +7.0%, −1.8% and −2.2%"): DERIVED + " (`jitter_per_seed`'s losses)",
    ("results.md", "| 2.6048 | +6.7% |"): DERIVED + " (the row's loss against sync's)",
    ("results.md", "| 2.3094 | −5.4% |"): DERIVED + " (the row's loss against sync's)",
    ("results.md", "one ended 6.7% above sync's loss"): DERIVED + " (the table's row)",
    ("results.md", "(p50 about 8.4 ms"): "a hand run whose JSON was not kept (the text says so)",
    ("results.md", "fp4 cuts the bytes 7.75×"): DERIVED + " (fp32's bytes_sent_per_worker ÷ fp4's)",
    ("results.md", "against fp32 at 7.75× fewer bytes"): DERIVED + " (fp32's bytes ÷ fp4's)",
    ("results.md", "| not reached (+1.8%) |"): DERIVED + " (the row's final loss against the target)",
    ("results.md", "and 1.8% (fp4) above the target"): DERIVED + " (the table's rows)",
    ("results.md", "the difference is 0.02% of a"): DERIVED + " ((85 − 64) µs ÷ 110 ms)",
    # whole percentages and multiples (WHOLE) on results.md and reproduction.md
    ("results.md", "DiLoCo sends 50× fewer bytes"): ISSUE_2 + " (581.3 MB / 11.6 MB, H = 50)",
    ("results.md", "from about 60% of the run on"): DERIVED + " (T = 400 of the fast shard's ~690 steps)",
    ("results.md", "took ~40% of the run"): "read from a run's events by hand (issue 8), not saved as JSON",
    ("results.md", "What the 8.5% between"): DERIVED + " (1 − the table's allreduce_ratio 0.915)",
    ("results.md", "| topk 10% + error feedback |"): "the codec's setting (--topk-fraction 0.1)",
    ("results.md", "top-k 10% with error feedback"): "the codec's setting (--topk-fraction 0.1)",
    ("results.md", "3% short of 1/1000"): DERIVED + " (1/969 against 1/1000)",
    (
        "results.md",
        "(3.06 bytes per token; 82% of the",
    ): "a profile of the encoding (py-spy) by hand, not saved",
    ("reproduction.md", "hold 8–54% of the text"): "the shards' sizes, read from the runs' shards.json",
    ("reproduction.md", "and 95% of a work's tokens"): "the shards' make-up, read from the runs' shards.json",
    ("reproduction.md", "communicating ~500× less"): "the paper's number (the claim)",
    ("reproduction.md", "while communicating 500× less"): "the paper's number (the claim)",
    ("reproduction.md", "closes a third (32%)"): DERIVED + " (the table's gaps)",
    ("reproduction.md", "with 20× fewer bytes"): "the paper's arithmetic (H = 1000 against 50)",
    ("reproduction.md", "where the paper's\n20× cost"): "the paper's arithmetic (H = 1000 against 50)",
    ("results.md", "one thread is ~16× faster"): "the machine's notes (a rule of thumb), not a result",
    ("results.md", "34,202 and 34,230 tokens/s by value against 34,674 and 34,968"): "an A/B run by hand, "
    "not kept (the text says so)",
    ("results.md", "sync 2.4461 (1,351 s)"): DERIVED + " (the seeds' sync sim_time_s, mean)",
    ("results.md", "(the two runs differ by 4%)"): DERIVED + " (async 1.798 against 1.725)",
    ("results.md", "(500 steps of a 4× batch)"): "the benchmark's settings (k = 4), not a result",
    ("results.md", "cannot explain a 2% gap"): DERIVED + " (1 − the ratio 0.982)",
    ("reproduction.md", "within 2% of data parallel at ≥ 400×"): "the issue's target, not a result",
    # plain numbers of two or three decimals (PLAIN) on results.md and reproduction.md
    ("results.md", "| 2.4902 | 12.06 |"): ISSUE_2 + " (perplexity: exp of the loss)",
    ("results.md", "| 2.4271 | 11.33 |"): ISSUE_2 + " (perplexity: exp of the loss)",
    ("results.md", "| 2.4934 | 12.10 |"): ISSUE_2 + " (perplexity: exp of the loss)",
    ("results.md", "A first measurement gave async 1.53"): HISTORY,
    (
        "results.md",
        "gave 0.96 at two threads",
    ): "a run with other work on the machine, not kept (the text says so)",
    ("results.md", "(fp4 at τ = 11: 0.56)"): HISTORY + " (read from that run's events)",
    ("results.md", "0.94 over 6 rounds"): HISTORY + " (read from that run's events)",
    ("results.md", "| fp4 | 16 | 1.95 | 2.7 s | 0.90 |"): SERVER_HISTORY + " (before fp4's byte table)",
    ("results.md", "MB (781) | 0.58–0.78 |"): "the lower end from another run, whose JSON was not kept",
    ("results.md", "20m fp4 × 16: 4.19 → 5.82"): SERVER_HISTORY + " (before and at e7d8f3d)",
    ("results.md", "0.84 and 1.0 GB in two runs"): "two runs' peaks that no JSON kept",
    ("results.md", "from 0.90 to 0.38 CPU"): SERVER_HISTORY + " (before and at e7d8f3d)",
    (
        "results.md",
        "allreduce_ratio 1.01/0.63 before, 0.70/0.91 after",
    ): "four runs by hand, not kept (the text says so)",
    ("results.md", "swings between 0.56 and 1.09"): "four runs by hand, not kept (the text says so)",
    (
        "results.md",
        "sync ratio 1.905 and",
    ): "the first of two runs; the file holds the second (the text says so)",
    (
        "results.md",
        "async ratio 1.798",
    ): "the first of two runs; the file holds the second (the text says so)",
    ("results.md", "ratio about 0.24, a hand run"): "a hand run whose JSON was not kept (the text says so)",
    ("results.md", "7.75× (0.52 bytes per value"): "the format's arithmetic (4 bits and a scale per block)",
    ("results.md", "read 0.29 and 0.51 on"): HISTORY + " (before issue 32's measure of utilisation)",
    ("results.md", "collective streaming 0.970"): HISTORY + " (earlier runs of this table)",
    ("results.md", "server streaming fp4 0.811"): HISTORY + " (earlier runs of this table)",
    ("results.md", "(0.129 / H)"): DERIVED + " (the formula's constant: bytes of a top-k value ÷ fp32's)",
    ("results.md", "gave 1.009 and 0.990"): "earlier runs during review, not kept (the text says so)",
    ("reproduction.md", "loss, a ratio: 1.84, 0.915;"): "examples of what the check reads (this test's own)",
    ("reproduction.md", "(DiLoCo +11.5% at k = 4 and +14.8% at k = 8 on tuned data parallel"): DERIVED
    + " (the reported seeds' losses, in the tuning rules' bullet)",
    ("reproduction.md", "(perplexity 15.02 vs 15.30, baseline 16.23)"): "the paper's numbers",
    ("reproduction.md", "2.8% against 2.1% below one worker"): DERIVED + " (the paper's, in log)",
    ("reproduction.md", "(15.02 and 16.23 to 15.30)"): "the paper's numbers",
    ("reproduction.md", "ends 2.3% above data parallel's pick"): DERIVED
    + " (the h500 table's tuning losses: 1.3457 against 1.3154)",
    ("reproduction.md", "(1.3365, 1.6% above data parallel's pick)"): DERIVED
    + " (the h500 table's tuning losses: 1.3365 against 1.3154)",
    ("reproduction.md", "ends at 1.3861, 5.4% above data"): DERIVED
    + " (the h500 table's tuning losses: 1.3861 against 1.3154)",
    ("reproduction.md", "1.3333, 1.4% above data parallel's pick"): DERIVED
    + " (the h500 table's tuning losses: 1.3333 against 1.3154)",
    ("reproduction.md", "pick ended 11.0% above"): DERIVED + " (§1's tuning table: 1.6710 against 1.5052)",
    (
        "reproduction.md",
        "(1.704 vs 1.752 at step 1,000)",
    ): "curve points read from run folders since lost (the text says so)",
    ("reproduction.md", "192: 5.5× nano"): DERIVED + " (2.7M parameters against nano's 0.49M)",
    ("reproduction.md", "its 8× batch ends 5.5% below its 4× batch"): DERIVED + " (the table's means)",
    ("reproduction.md", "perplexity (15.02 vs 15.30)"): "the paper's numbers",
    ("reproduction.md", "its loss by 0.071 against"): DERIVED + " (the table's means)",
    ("reproduction.md", "falls by\n0.032 (1.6352"): DERIVED + " (1.6352 − 1.6031)",
    ("reproduction.md", "perplexity 15.18 / 15.02 / 14.91 / 14.96"): "the paper's numbers",
    ("reproduction.md", "perplexity (15.18/15.02/14.91)"): "the paper's numbers",
    (
        "reproduction.md",
        "0.22 / 0.25 / 0.43 / 0.10 on seed 0, 0.08 / 0.24 /\n"
        "0.53 / 0.14 on seed 1 and 0.23 / 0.13 / 0.13 / 0.52",
    ): "the shards' weights, read from the runs' shards.json",
    (
        "reproduction.md",
        "weights 0.34 / 0.32 / 0.10 / 0.24, 0.51 / 0.08 / 0.24 / 0.17 and 0.37 / 0.30 / 0.12 / 0.21",
    ): "the shards' weights of a rerun, read from its shards.json",
    ("reproduction.md", "ends only +2.9% in perplexity"): "the paper's number (the claim)",
    ("reproduction.md", "ends 5.3% above Nesterov on seed 0"): DERIVED + " (2.1542 / 2.0465)",
    ("reproduction.md", "clearly worse on seed 0 (+5.3%)"): DERIVED + " (2.1542 / 2.0465)",
    ("reproduction.md", "+0.39%, 4 → 8 +0.08%, 8 → 4 +0.02%"): DERIVED
    + " (the schedules' means against the constant ones')",
    # the other pages: mostly results.md's figures again, settings and design arithmetic
    ("async.md", "a 5.7× spread"): SETTINGS,
    ("async.md", "slight 1.5×"): "the --heterogeneity presets' spreads (settings)",
    ("async.md", "ended 4.3–5.0% below plain sync"): DERIVED + " (1 − the loss ratios; results.md)",
    ("async.md", "ended\n5.1–6.0% below"): DERIVED + " (1 − the loss ratios; results.md)",
    ("async.md", "1.6% above sync + DyLU"): DERIVED + " (`warm_lr_probe`: 2.05108 / 2.01828)",
    (
        "async.md",
        "Over 2.9 s (a tenth of a",
    ): "what `--grace-s auto` works out to at these speeds (not saved)",
    ("async.md", "T = 2.9 s"): "what `--grace-s auto` works out to at these speeds (not saved)",
    ("async.md", "2.4414, +7.1%"): DERIVED + " (2.6147 / 2.4414)",
    ("async.md", "none of 4; +5.0% against sync"): HISTORY + " (before deadlines ended together; 0c6484b)",
    ("communication.md", "4 bytes in 256 (1.6%)"): DERIVED + " (4 / 256: the format's arithmetic)",
    ("communication.md", "0.03 × 14 / 8"): "the format's arithmetic (density × bits per value)",
    ("distributed.md", "0.7 s per GB"): "SHA-256 of 1 GB timed by hand on this machine (4348f93)",
    ("method.md", "costs +2.9% perplexity"): "the paper's number (the claim)",
    ("method.md", "costs +0.4%"): "the paper's number (the claim)",
    ("planning.md", "~0.1–0.2 s a job or round"): DERIVED + " (the calibration's residuals, below)",
    ("planning.md", "~0.4 s longer"): "a torchrun row's per-round exchange times, from its run folder",
    (
        "planning.md",
        "0.64 s of communication",
    ): "a torchrun row's per-round exchange times, from its run folder",
    ("planning.md", "jobs 2.5× longer"): SETTINGS + " (H = 25 against 10)",
    ("planning.md", "need 2.5× (1B) and 4× (10B) less"): DERIVED + " (the table's planned_gbit_s)",
    ("planning.md", "another 7.7× less"): DERIVED + " (the table's planned_gbit_s)",
    ("server.md", "ending 4.3–5.0% below sync"): DERIVED + " (1 − the loss ratios; results.md)",
    ("server.md", "0.1 s growing to 2 s apart"): "gRPC's reconnect backoff as set (settings)",
    ("server.md", "1.8–6.7 GB before)"): SERVER_HISTORY + " (before 463f789)",
    ("server.md", "(3.2×\n  more pushes per second"): DERIVED + " (8 / 2.5 bytes per parameter)",
    ("simulator.md", "give 1.7× the tokens/s"): DERIVED + " (36,899 / 21,739 tokens/s; results.md)",
    ("your_data.md", "validate on 0.04% of the text"): "an example worked by hand (91 rows)",
}


def _sections(doc: str):
    """(first line, section text) of each ## / ### section, code blocks blanked, each generated
    table reduced to its marker (which names its JSON)."""
    text = (ROOT / "docs" / doc).read_text()
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(
        r"(?m)^(<!-- table:[^>]*-->).*?<!-- /table -->",
        lambda m: m.group(1) + "\n" * m.group(0).count("\n"),
        text,
        flags=re.S,
    )
    line = 1
    for sec in re.split(r"(?m)^(?=#{2,3} )", text):
        yield line, sec
        line += sec.count("\n")


def _exempt(doc: str, sec: str, start: int, end: int) -> tuple[str, str] | None:
    """The UNIT_EXEMPT key whose fragment covers sec[start:end], if any."""
    for d, fragment in UNIT_EXEMPT:
        if d == doc and any(
            m.start() <= start and end <= m.end() for m in re.finditer(re.escape(fragment), sec)
        ):
            return d, fragment
    return None


def _unit_numbers():
    """(doc, number as written, unit, files its section cites, its exemption's key or None)."""
    for doc in DOCS:
        for first, sec in _sections(doc):
            files = tuple(sorted({m.group(1) for m in CITED.finditer(sec)}))
            whole = (
                [*WHOLE.finditer(sec), *PLAIN.finditer(sec), *GROUPED.finditer(sec)]
                if doc in WHOLE_DOCS
                else []
            )
            found = [*UNIT.finditer(sec), *whole, *RANGE.finditer(sec)]
            ranges = {m.start(1) for m in RANGE.finditer(sec)}  # a range's first number, once
            found = [m for m in found if m.re is not PLAIN or m.start(1) not in ranges]
            code = [c.span() for c in re.finditer(r"`[^`\n]+`", sec)]  # a flag's value: a setting
            found = [
                m for m in found if m.re not in (PLAIN, WHOLE) or not any(a < m.start() < b for a, b in code)
            ]
            for m in sorted(found, key=lambda m: m.start()):
                line = first + sec.count("\n", 0, m.start())
                written, unit = m.group(1), (m.group(2) or "").strip() if m.re is not PLAIN else ""
                written = written.replace(",", "")
                key = _exempt(doc, sec, m.start(), m.start(1) + len(written))
                yield pytest.param(doc, written, unit, files, key, id=f"{doc}:{line}:{written}{unit}")


def _unit_matches(written: str, unit: str, files: tuple[str, ...]) -> bool:
    x = abs(float(written.replace("−", "-")))
    tol = 0.5 * 10 ** -len(written.partition(".")[2]) * (1 + 1e-9)
    # a whole 12% or 50× is a measured ratio's, not a setting's 12 or 50 (1,938 MB may be bytes)
    floats = "." not in written and unit in ("%", "×")
    # a grid's setting written bare ("0.71 ends at") may be its key; never with a unit (1.4% ≠ 1.4)
    values = (v for f in files for v in _file_values(f, floats, keys=unit == ""))
    return any(abs(abs(v) * s - x) <= tol for v in values for s in SCALES[unit])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("doc,written,unit,files,exempt", list(_unit_numbers()))
def test_a_number_with_a_unit_is_in_a_json_its_section_cites(doc, written, unit, files, exempt):
    if exempt:
        pytest.skip(UNIT_EXEMPT[exempt])
    assert files, f"{doc}: {written}{unit} is in a section that cites no JSON file"
    assert _unit_matches(written, unit, files), f"{doc}: {written}{unit} is in none of {', '.join(files)}"


@pytest.mark.timeout(60)
def test_every_unit_exemption_still_covers_a_number():
    used = {p.values[4] for p in _unit_numbers()}
    stale = [fragment for key in UNIT_EXEMPT if key not in used for fragment in key[1:]]
    assert not stale, f"exemptions that no longer cover a number: {stale}"


@pytest.mark.timeout(60)
def test_the_unit_check_can_fail():
    """The validation cost's push p50 is its dated file's 6.904 ms; 7.0 ms is not."""
    assert _unit_matches("6.9", "ms", ("server_transport_nano_2026-12-01.json",))
    assert not _unit_matches("7.0", "ms", ("server_transport_nano_2026-12-01.json",))
    assert len(list(_unit_numbers())) > 300
    # a whole percentage: collective.json's throughput ratio 0.986 is 99%, not 97% (no value near)
    assert _unit_matches("99", "%", ("collective.json",))
    assert not _unit_matches("97", "%", ("collective.json",))
    whole = [p for p in _unit_numbers() if p.values[0] in WHOLE_DOCS and "." not in p.values[1]]
    assert len(whole) > 100
    assert not [m.group(0) for m in WHOLE.finditer("batch 16 × 128, 8 × 512 × 1,024 tokens")]  # products
    # reproduction.md names a table marker in backticks (its last section); it is no table, and the
    # text after it is read: until 2026-12-06 it was blanked up to the next real table's end (then
    # the tuning rules, the lane and §1's first part). The intro before §1 is read too.
    lines = (ROOT / "docs" / "reproduction.md").read_text().splitlines()
    marker = next(i for i, x in enumerate(lines, 1) if "`<!-- table:" in x)
    part1 = next(i for i, x in enumerate(lines, 1) if x.startswith("## 1."))
    read = [int(p.id.split(":")[1]) for p in _unit_numbers() if p.id.startswith("reproduction.md:")]
    assert len([n for n in read if n > marker]) >= 5 and len([n for n in read if n < part1]) > 20
    # thousands: issue 2's table (21,739 tokens/s) is its dated file's, not the later run's
    assert _unit_matches("21739", "tokens/s", ("overhead_2026-11-30_e3379a0.json",))
    assert not _unit_matches("21739", "tokens/s", ("overhead.json",))
    assert [m.group(1) for m in GROUPED.finditer("| 21,739 | 1,938 MB, 10,000 steps, 4,096-token")] == [
        "21,739",
        "1,938",
    ]
    # a plain ratio: issue 3's table (sync 1.84) is the dated file's, not the later run's (1.861)
    assert _unit_matches("1.84", "", ("sim_parallel_2026-11-30.json",))
    assert not _unit_matches("1.84", "", ("sim_parallel.json",))
    assert [m.group(1) for m in PLAIN.finditer("torch 2.13.0, ≥ 0.95, 2.46M, 1.84 and 0.915")] == [
        "1.84",
        "0.915",
    ]
