"""A benchmark JSON's per-seed summary fields hold what its own per-seed entries say.

async_vs_sync.py writes, for each list `{prefix}per_seed` (one row per seed, a dict per method),
`{prefix}{method}_{field}_by_seed` and, for its headline method dn_dylu, the bare
`{prefix}{field}_by_seed`. async_extra.json once summarised dn_dylu in a run that did not have it
and wrote `[null, null]` beside per-seed values of 1.604 and 1.65 (issue 36)."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
HEADLINE = "dn_dylu"  # the method a bare `{prefix}{field}_by_seed` summarises (async_vs_sync.py)


def _groups(data: dict):
    """(prefix, per-seed rows, their methods, their fields) for each `{prefix}per_seed` list."""
    for key, rows in data.items():
        if key.endswith("per_seed") and isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
            methods = {m for r in rows for m, v in r.items() if isinstance(v, dict)}
            fields = {f for r in rows for m in methods for f in (r.get(m) or {})}
            if methods:
                yield key[: -len("per_seed")], rows, methods, fields


def _summaries(data: dict):
    """(key, method, field, value, per-seed rows) for every `_by_seed` summary of a per-seed list;
    method None: a summary of a method the rows do not have."""
    for prefix, rows, methods, fields in _groups(data):
        for key, value in data.items():
            if not (key.startswith(prefix) and key.endswith("_by_seed") and isinstance(value, list)):
                continue
            name = key[len(prefix) : -len("_by_seed")]
            hits = sorted((m for m in methods if name.startswith(m + "_")), key=len, reverse=True)
            if hits:  # dn_dylu_oracle before dn_dylu
                yield key, hits[0], name[len(hits[0]) + 1 :], value, rows
            elif name in fields:  # bare: the headline method's
                yield key, HEADLINE if HEADLINE in methods else None, name, value, rows


def _cases():
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            for key, method, field, value, rows in _summaries(data):
                yield pytest.param(key, method, field, value, rows, id=f"{path.name}:{key}")


CASES = list(_cases())


@pytest.mark.timeout(30)
def test_there_are_per_seed_summaries_to_check():
    ids = {c.id for c in CASES}
    assert "async_extra.json:dn_dylu_sampling_speedup_at_own_final_by_seed" in ids
    assert {"async_vs_sync.json:warm_speedup_by_seed", "async_vs_sync.json:jitter_speedup_by_seed"} <= ids
    assert len(CASES) >= 12


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("key", "method", "field", "value", "rows"), CASES)
def test_a_by_seed_summary_equals_the_per_seed_entries(key, method, field, value, rows):
    assert method is not None, f"{key} summarises {HEADLINE}, which the run did not have"
    assert value == [(r.get(method) or {}).get(field) for r in rows], key


@pytest.mark.timeout(30)
def test_the_check_catches_a_summary_of_a_method_the_run_did_not_have():
    """The defect as it was: dn_dylu summarised in a run of dn_dylu_sampling and dn_dylu_oracle."""
    old = {
        "per_seed": [{"seed": 0, "dn_dylu_sampling": {"speedup": None, "speedup_at_own_final": 1.604}}],
        "speedup_by_seed": [None],
        "dn_dylu_speedup_at_own_final_by_seed": [None],
    }
    got = {key: method for key, method, *_ in _summaries(old)}
    assert got == {"speedup_by_seed": None}  # bare: dn_dylu's, absent
    # a prefixed name of an absent method is no method's summary: it must not pass unread either
    assert "dn_dylu_speedup_at_own_final_by_seed" not in got
    orphans = [k for k in old if k.endswith("_by_seed") and k not in got]
    assert orphans == ["dn_dylu_speedup_at_own_final_by_seed"]


@pytest.mark.timeout(30)
def test_every_by_seed_field_is_a_summary_the_check_reads():
    """A `_by_seed` field beside a per-seed list that no method or bare field explains (such as
    `dn_dylu_speedup_at_own_final_by_seed` in a run without dn_dylu) fails."""
    unread = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            continue
        groups = list(_groups(data))
        if not groups:
            continue
        read = {key for key, *_ in _summaries(data)}
        prefixes = [p for p, *_ in groups]
        for key, value in data.items():
            if key.endswith("_by_seed") and isinstance(value, list) and key not in read:
                # only fields that look like a per-seed list's: a prefix of one and a field it has
                fields = {f for p, _, _, fs in groups if key.startswith(p) for f in fs}
                if any(key.endswith(f"_{f}_by_seed") for f in fields) and any(
                    key.startswith(p) for p in prefixes
                ):
                    unread.append(f"{path.name}:{key}")
    assert unread == []
