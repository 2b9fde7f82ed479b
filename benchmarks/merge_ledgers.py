"""Merge ledgers written by runs from other worktrees into the one kept in git.

Long benchmarks run from a frozen `git worktree`, each with its own copy of a ledger (`--ledger`
of reproduce_diloco.py and bytes_to_loss.py; the `--out` folder of async_jitter.py). This puts
the rows those copies gained back into the ledger in git:

- a reproduce ledger (rows keyed by `name`) stays sorted by name, as `Ledger.save` writes it; a
  copy's row replaces the ledger's only when the ledger's has no curve and the copy's has one
  (a hand-rebuilt row run again), with the same val_loss (else the merge stops: a run that is
  not deterministic needs a look, not a silent pick);
- an async_jitter ledger (rows keyed by `run`) keeps its lines as they are and appends the new
  ones in the order the copies have them;
- a reproduce ledger's part_timing.json (beside its runs.jsonl) takes, part by part, a copy's
  entry that has counted more runs than its own, or as many over more elapsed time (a part's
  totals only grow as a lane runs it, its time each minute a run is in flight; the parts a lane
  never ran are the ledger's own, copied when the lane was seeded).

    python benchmarks/merge_ledgers.py benchmarks/results/reproduce_ledger/runs.jsonl COPY...
    python benchmarks/merge_ledgers.py benchmarks/results/async_jitter_ledger.jsonl COPY...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _rows(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def merge(into: Path, copies: list[Path]) -> int:
    """Merges `copies` into `into` (rewritten whole through a temporary file); the rows added."""
    lines = _rows(into)
    key = "name" if lines and "name" in json.loads(lines[0]) else "run"
    added = 0
    if key == "run":
        have = {json.loads(line)["run"] for line in lines}
        for copy in copies:
            for line in _rows(copy):
                if json.loads(line)["run"] not in have:
                    lines.append(line)
                    have.add(json.loads(line)["run"])
                    added += 1
        text = "".join(line + "\n" for line in lines)
    else:
        rows = {json.loads(line)["name"]: json.loads(line) for line in lines}
        for copy in copies:
            for line in _rows(copy):
                row = json.loads(line)
                old = rows.get(row["name"])
                if old is None:
                    added += 1
                elif old.get("curve") or not row.get("curve"):
                    continue
                elif "summary" in old and "summary" in row:
                    a, b = old["summary"].get("val_loss"), row["summary"].get("val_loss")
                    if a is None or b is None or abs(a - b) > 1e-5:
                        raise SystemExit(
                            f"{row['name']}: val_loss {b} in {copy}, {a} in {into}: not deterministic"
                        )
                rows[row["name"]] = row
        text = "".join(json.dumps(rows[n], sort_keys=True) + "\n" for n in sorted(rows))
    tmp = into.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, into)
    return added


def merge_timing(into: Path, copies: list[Path]) -> list[str]:
    """Merges the copies' part_timing.json into `into` (the one beside the ledger in git): a part's
    entry from the copy that has counted the most new runs, where that is more than its own, or
    as many over more elapsed time (a lane records its parts' time while runs are in flight). The
    parts taken, in order."""

    def counted(entry: dict) -> tuple[int, float]:
        return entry.get("new_runs") or 0, entry.get("elapsed_s") or 0.0

    mine = json.loads(into.read_text()) if into.is_file() else {}
    taken = []
    for copy in copies:
        for part, entry in json.loads(copy.read_text()).items():
            if counted(entry) > counted(mine.get(part, {})):
                mine[part] = entry
                taken.append(part)
    if taken:
        tmp = into.with_suffix(".tmp")
        tmp.write_text(json.dumps(mine, indent=2) + "\n")
        os.replace(tmp, into)
    return list(dict.fromkeys(taken))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("into", type=Path, help="the ledger kept in git")
    ap.add_argument("copies", type=Path, nargs="+", help="ledgers written from other worktrees")
    args = ap.parse_args()
    for p in [args.into, *args.copies]:
        if not p.is_file():
            ap.error(f"{p} is not a file")
    added = merge(args.into, args.copies)
    print(f"{args.into}: {added} rows added", file=sys.stderr)
    timing = [c.parent / "part_timing.json" for c in args.copies if (c.parent / "part_timing.json").is_file()]
    if args.into.name == "runs.jsonl" and timing:
        parts = merge_timing(args.into.parent / "part_timing.json", timing)
        print(
            f"{args.into.parent / 'part_timing.json'}: {', '.join(parts) or 'no part'} taken", file=sys.stderr
        )


if __name__ == "__main__":
    main()
