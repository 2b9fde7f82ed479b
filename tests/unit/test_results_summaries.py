"""A benchmark JSON's per-seed summary fields (`{method}_{field}_by_seed`) hold what its own
`per_seed` entries say: async_extra.json once summarised a method the run did not have and wrote
`[null, null]` beside per-seed values of 1.604 and 1.65 (issue 36)."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _summaries():
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        seeds = data.get("per_seed") if isinstance(data, dict) else None
        if not isinstance(seeds, list):
            continue
        methods = {m for s in seeds if isinstance(s, dict) for m, v in s.items() if isinstance(v, dict)}
        for key, value in data.items():
            if not key.endswith("_by_seed"):
                continue
            # the longest method name the key starts with: dn_dylu_oracle before dn_dylu
            hits = sorted((m for m in methods if key.startswith(m + "_")), key=len, reverse=True)
            if hits:
                yield path.name, key, hits[0], key[len(hits[0]) + 1 : -len("_by_seed")], value, seeds


CASES = list(_summaries())


@pytest.mark.timeout(30)
def test_there_are_per_seed_summaries_to_check():
    names = {(name, key) for name, key, *_ in CASES}
    assert ("async_extra.json", "dn_dylu_sampling_speedup_at_own_final_by_seed") in names
    assert len(CASES) >= 8


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("name", "key", "method", "field", "value", "seeds"), CASES, ids=[c[1] for c in CASES]
)
def test_a_by_seed_summary_equals_the_per_seed_entries(name, key, method, field, value, seeds):
    assert value == [(s.get(method) or {}).get(field) for s in seeds], f"{name}: {key}"


def _orphans(data: dict) -> list[str]:
    """`*_{field}_by_seed` summaries all null while some method's per-seed `field` has values, and
    whose prefix names no method of the run: a summary of a method the run did not have."""
    seeds = data.get("per_seed")
    if not isinstance(seeds, list):
        return []
    entries = [v for s in seeds if isinstance(s, dict) for v in s.values() if isinstance(v, dict)]
    methods = {m for s in seeds if isinstance(s, dict) for m, v in s.items() if isinstance(v, dict)}
    fields = {f for e in entries for f, v in e.items() if v is not None}
    out = []
    for key, value in data.items():
        if not (key.endswith("_by_seed") and isinstance(value, list) and all(v is None for v in value)):
            continue
        for f in fields:
            prefix = key[: -len(f"_{f}_by_seed")]
            if key.endswith(f"_{f}_by_seed") and prefix and prefix not in methods:
                out.append(key)
    return out


@pytest.mark.timeout(30)
def test_no_summary_names_a_method_the_run_did_not_have():
    bad = {p.name: _orphans(json.loads(p.read_text())) for p in sorted(RESULTS.glob("*.json"))}
    assert {name: keys for name, keys in bad.items() if keys} == {}
    # the defect as it was: summarising dn_dylu in a run of dn_dylu_sampling and dn_dylu_oracle
    old = {
        "per_seed": [{"dn_dylu_sampling": {"speedup_at_own_final": 1.604}}],
        "dn_dylu_speedup_at_own_final_by_seed": [None],
    }
    assert _orphans(old) == ["dn_dylu_speedup_at_own_final_by_seed"]
