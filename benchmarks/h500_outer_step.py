"""Where H = 500's first rounds go (issue 36; docs/reproduction.md §11): the outer step or the average.

Every tuning run of reproduce_diloco.py's part H500 at H = 500 first rises far above its warm
start, and no run at H = 50 does. Two readings: the average of k workers 500 steps apart is a
bad model, or the outer Nesterov step, (1 + momentum) × the outer lr × the average outer_grad at
its first step (1.9× at momentum 0.9, lr 1), lands past the average. This runs H = 500's tuning
pick (seed 100, tuning split, k = 4, its inner lr and warm-up, from
reproduce_diloco_H500.json) again, evaluating after every round, in two arms:

- `nesterov`: as tuned;
- `average`: outer SGD at lr 1 without momentum, so the global model is the workers' average.

Each arm is `diloco train` with reproduce_diloco.py's command for that run, plus `--stop-after`
below 20 rounds (the inner lr keeps its 10,000-step schedule either way). The arms named run at
once, one thread each, after the tuning seed's pretraining (~2.5 min, once per workdir); ~25 min
for both at 3 rounds beside the lane, a whole run (20 rounds) ~1.5-2 h. JSON:
benchmarks/results/h500_outer_step.json, one entry per arm (its curve, `peak` as in part H500's
JSON, its rounds, a whole run's `val_loss`); an invocation replaces the entries of the arms it
runs and keeps the others. `ledger_curve` is the tuned run's ledger curve beside the nesterov
arm's: made on another machine, whose kernels round differently in the last bits, so the two
agree at the start and drift apart (`vs_ledger_max_rel`) as H = 500's first rounds amplify it.

    python benchmarks/h500_outer_step.py [--rounds 3] [--arms nesterov,average] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import reproduce_diloco as rd  # noqa: E402  (the runs' commands, names and curves)

OUT = ROOT / "benchmarks" / "results" / "h500_outer_step.json"
H500 = ROOT / "benchmarks" / "results" / "reproduce_diloco_H500.json"
H = 500
ARMS = ("nesterov", "average")
OUTER_FLAGS = ("--outer-opt", "--outer-lr", "--outer-momentum")


def _log(text: str) -> None:
    print(f"[h500_outer_step] {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def _ctx(workdir: Path) -> rd.Ctx:
    """reproduce_diloco's context as its lane runs part H500 (nano, 3 seeds), with the ledger in
    git (read only) and run folders in `workdir`."""
    args = argparse.Namespace(
        quick=False, ks=rd.DP_KS, starts=("scratch", "warm"), lr_grid=rd.OUTER_LR_GRID, serial_ks=None,
        model="nano", steps=1000, H=50, hs=None, h_k=rd.K, seeds=3, pretrain_steps=1000, jobs=2,
        workdir=workdir, ledger=rd.RESULTS / "reproduce_ledger" / "runs.jsonl",
    )  # fmt: skip
    args.serial_ks = args.ks
    return rd.Ctx(args)


def make_arms(ctx: rd.Ctx, pick: dict) -> dict[str, rd.Run]:
    """The two arms at H = 500's tuning pick (`pick`: its entry in reproduce_diloco_H500.json)."""
    common = dict(k=rd.K, H=H, warm=True, fair=True, tuning=True, steps=rd.H500_STEPS)
    common.update(inner_lr=pick["inner_lr"], warmup=pick["warmup"])
    return {
        "nesterov": ctx.diloco(rd.TUNE_SEED, lr=pick["outer_lr"], **common),
        "average": ctx.diloco(rd.TUNE_SEED, lr=1.0, opt="sgd", momentum=0.0, **common),
    }


def _train(ctx: rd.Ctx, run: rd.Run, rounds: int | None = None) -> bool:
    """`diloco train` for `run` (one thread) up to `rounds` (None: the whole run). A folder that
    has got there is reused (False), one with an earlier checkpoint resumes from it (bit for
    bit), any other starts over; exits naming the run on failure."""
    from diloco.rundir import checkpoint

    d = ctx.dir(run)
    done = checkpoint.rounds(d / "checkpoints") if (d / "checkpoints").is_dir() else []
    if (d / "summary.json").is_file() or (rounds is not None and rounds in done):
        return False
    if done and (rounds is None or done[-1] < rounds):
        cmd = ctx.command(run, resume=True)
        _log(f"{run.label}: resumed from round {done[-1]}")
    else:
        shutil.rmtree(d, ignore_errors=True)
        cmd = ctx.command(run)
    cmd += [] if rounds is None else ["--stop-after", str(rounds)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"h500_outer_step: {run.label} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return True


def arm_rounds(text: str) -> dict[str, int]:
    """`--arms`: "nesterov:3,average:20" (an arm without its rounds runs 3)."""
    out = {}
    for word in (w.strip() for w in text.split(",") if w.strip()):
        name, _, n = word.partition(":")
        if name not in ARMS or (n and not n.isdigit()):
            raise argparse.ArgumentTypeError(f"{word!r}: an arm is one of {', '.join(ARMS)}, then :ROUNDS")
        out[name] = int(n) if n else 3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--arms",
        type=arm_rounds,
        default="nesterov:3,average:3",
        help="the arms and their outer rounds, a comma list (default nesterov:3,average:3; 20: a whole run)",
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/h500_outer_step"))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    whole = rd.H500_STEPS // H
    if bad := {a: n for a, n in args.arms.items() if not 1 <= n <= whole}:
        ap.error(f"an arm's rounds must be 1 to {whole}, got {bad}")
    pick = json.loads(H500.read_text())["by_H"][str(H)]
    if pick.get("outer_lr") is None or pick.get("inner_lr") is None:
        sys.exit(f"h500_outer_step: {H500.name} has no H = {H} pick yet; run part H500's tuning first")
    ctx = _ctx(args.workdir)
    arms = {name: run for name, run in make_arms(ctx, pick).items() if name in args.arms}
    tuned = make_arms(ctx, pick)["nesterov"]
    row = ctx.ledger.rows.get(tuned.name)
    if row is None or not row.get("curve"):
        sys.exit(f"h500_outer_step: the ledger has no curve for {tuned.name}; merge the lane's ledger")
    t0 = time.perf_counter()
    if not (ctx.dir(tuned.init) / "summary.json").is_file():  # a pretraining run made before is reused
        _log(f"pretraining {tuned.init.label} in {args.workdir}")
        _train(ctx, tuned.init)
    _log(f"at once: {', '.join(f'{a} {n} rounds' for a, n in args.arms.items())}")

    def run_arm(name: str) -> bool:
        return _train(ctx, arms[name], None if args.arms[name] == whole else args.arms[name])

    with ThreadPoolExecutor(len(arms)) as pool:
        ran = dict(zip(arms, pool.map(run_arm, arms), strict=True))
    spent = round(time.perf_counter() - t0, 1)
    h500 = json.loads(H500.read_text())
    dp = h500["dp"]["tuning"]
    dp_loss = dp["grid"][rd._num(dp["lr"])]  # data parallel's pick on the tuning split
    tuned_loss = pick["lr_grid_tuning"][rd._num(pick["outer_lr"])]  # the nesterov pick's whole run
    setting = {"seed": rd.TUNE_SEED, "split": "tuning", "k": rd.K, "H": H, "steps_per_worker": rd.H500_STEPS}
    setting.update(inner_lr=pick["inner_lr"], warmup=pick["warmup"])
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if {k: result.get(k) for k in setting} != setting:
        result = {}  # another pick: the arms run before are not comparable
    result = {"benchmark": "h500_outer_step", **setting, "arms": result.get("arms", {})}
    for name, run in arms.items():
        old = result["arms"].get(name) or {}
        same = old.get("run") == run.name and old.get("rounds") == args.arms[name]
        xs, ys = ctx.curve(run.name)
        summary = ctx.dir(run) / "summary.json"
        loss = json.loads(summary.read_text())["val_loss"] if summary.is_file() else None
        result["arms"][name] = {
            "outer": {f: run.flags[run.flags.index(f) + 1] for f in OUTER_FLAGS if f in run.flags},
            "run": run.name,
            "rounds": args.arms[name],
            "curve": [[x, round(y, 5)] for x, y in zip(xs, ys, strict=True)],
            "peak": rd.peak(xs, ys),
            # a whole run's final loss on the tuning split, as lr_grid_tuning's
            "val_loss": loss,
            "vs_dp_pick": round(loss / dp_loss - 1, 4) if loss else None,
            "vs_tuned_pick": round(loss / tuned_loss - 1, 4) if loss else None,
            # the invocation's that ran it (its arms at once, beside the lane); a folder reused keeps it
            "elapsed_s": spent if ran[name] else (old.get("elapsed_s") if same else None),
        }
    mine = result["arms"].get("nesterov", {}).get("curve") or []
    ledger = row["curve"][: len(mine)]
    result["ledger_curve"] = ledger
    result["vs_ledger_max_rel"] = (
        round(max(abs(a[1] - b[1]) / b[1] for a, b in zip(mine, ledger, strict=True)), 4) if mine else None
    )
    result["note"] = (
        "each arm's mean evaluation on the tuning split's fixed subset after every round (step 0: the warm "
        "start); nesterov = part H500's H = 500 tuning pick, run again beside average on one machine; "
        "ledger_curve = the same run's first rounds in the ledger, made on another machine: its kernels "
        "round differently in the last bits (the pretraining's val_loss differs in the 8th digit), which "
        "H = 500's first rounds amplify (vs_ledger_max_rel); average = outer SGD lr 1 without momentum, "
        "the workers' plain average; peak as in reproduce_diloco_H500.json; val_loss a whole run's, "
        "vs_dp_pick against data parallel's pick and vs_tuned_pick against the nesterov pick's whole run "
        "(both in reproduce_diloco_H500.json, the tuning split, made on the other machine)"
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
