#!/bin/bash
# Issue 36's lane: reproduce_diloco.py's four invocations, one after another, two runs at a time,
# from a frozen worktree (docs/reproduction.md, "Issue 36"). Run it from the worktree's root:
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
set -u
L=${1:?usage: reproduce_lane.sh LANE [PYTHON]}
PY=${2:-python}
[ -f benchmarks/reproduce_diloco.py ] || { echo "run from a worktree's root" >&2; exit 2; }
mkdir -p "$L"
for pair in reproduce_ledger:ledger reproduce_micro_ledger:micro_ledger; do
    [ -d "$L/${pair#*:}" ] || cp -r "benchmarks/results/${pair%%:*}" "$L/${pair#*:}"
done
export PYTHONPATH=src:benchmarks OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
R="$PY benchmarks/reproduce_diloco.py --jobs 2"
nano=(--workdir "$L/work" --ledger "$L/ledger")
micro=(--model micro --steps 1000 --workdir "$L/micro_work" --ledger "$L/micro_ledger")
{
    $R --part dp,drop,H500 "${nano[@]}" --out "$L/reproduce_diloco.json" &&
    $R --part dp --ks 8 --starts warm,scratch --dp-hs 10,50 "${nano[@]}" --out "$L/reproduce_diloco_k8.json" &&
    $R --part dp --ks 8 --starts warm --dp-hs 10,50 "${micro[@]}" --out "$L/reproduce_diloco_micro_k8.json" &&
    $R --part dp "${micro[@]}" --out "$L/reproduce_diloco_micro.json" &&
    echo LANE DONE
} >> "$L/log" 2>&1
