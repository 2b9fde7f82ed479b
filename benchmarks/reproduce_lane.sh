#!/bin/bash
# Issue 36's lane: reproduce_diloco.py's four invocations, one after another, two runs at a time,
# from a frozen worktree (docs/reproduction.md, "Issue 36's lane"). The first names part H500,
# then drop, then dp: parts go in the order given, so the paper's headline runs first, part drop's
# paper configuration (about 1 h) next, and part dp's from-scratch grids (about 7 h) last. Run it
# from the worktree's root:
#
#   git worktree add --detach /work/wt/repro main
#   cd /work/wt/repro && setsid nohup bash benchmarks/reproduce_lane.sh "$LANE" "$PY" >/dev/null 2>&1 &
#
# LANE holds the run folders (work/, micro_work/), the ledgers' copies (ledger/, micro_ledger/,
# made from the worktree's on the first start) and the log; PY is the python with diloco (default
# python). Stopped and started again (a session's end, a CI run), every run resumes from its
# latest checkpoint and finished runs are not run again. At a session's end:
#   python benchmarks/merge_ledgers.py benchmarks/results/reproduce_ledger/runs.jsonl "$LANE/ledger/runs.jsonl"
#   python benchmarks/merge_ledgers.py benchmarks/results/reproduce_micro_ledger/runs.jsonl "$LANE/micro_ledger/runs.jsonl"
# With --pending as the third argument it starts nothing and prints what is left: each
# invocation's `--pending` (a run an earlier one counts is not counted again) and the total.
set -u
L=${1:?usage: reproduce_lane.sh LANE [PYTHON] [--pending]}
PY=${2:-python}
[ -f benchmarks/reproduce_diloco.py ] || { echo "run from a worktree's root" >&2; exit 2; }
mkdir -p "$L"
for pair in reproduce_ledger:ledger reproduce_micro_ledger:micro_ledger; do
    [ -d "$L/${pair#*:}" ] || cp -r "benchmarks/results/${pair%%:*}" "$L/${pair#*:}"
done
export PYTHONPATH=src:benchmarks OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
nano="--workdir $L/work --ledger $L/ledger"
micro="--model micro --steps 1000 --workdir $L/micro_work --ledger $L/micro_ledger"
invocations=(
    "--part H500,drop,dp $nano --out $L/reproduce_diloco.json"
    "--part dp --ks 8 --starts warm,scratch --dp-hs 10,50 $nano --out $L/reproduce_diloco_k8.json"
    "--part dp --ks 8 --starts warm --dp-hs 10,50 $micro --out $L/reproduce_diloco_micro_k8.json"
    "--part dp $micro --out $L/reproduce_diloco_micro.json"
)
if [ "${3:-}" = --pending ]; then
    pendings=()
    for i in "${!invocations[@]}"; do
        after=()
        [ ${#pendings[@]} -gt 0 ] && after=(--pending-after "${pendings[@]}")
        # shellcheck disable=SC2086  # each invocation's words
        $PY benchmarks/reproduce_diloco.py --jobs 2 ${invocations[$i]} --pending "${after[@]}" > "$L/pending_$i.json" || exit 1
        pendings+=("$L/pending_$i.json")
    done
    exec $PY -c '
import json, sys
rows = [json.load(open(p)) for p in sys.argv[1:]]
for p, r in zip(sys.argv[1:], rows):
    h, n = r["run_time_h"], len(r["runs"])
    print(f"{p}: {h} h of run time, {n} runs not counted before")
total = sum(r["run_time_h"] for r in rows)
print(f"the lane: {total:.1f} h of run time, {total / 2:.1f} h elapsed two at a time (a lower bound)")
' "${pendings[@]}"
fi
{
    for args in "${invocations[@]}"; do
        # shellcheck disable=SC2086
        $PY benchmarks/reproduce_diloco.py --jobs 2 $args || exit 1
    done
    echo LANE DONE
} >> "$L/log" 2>&1
