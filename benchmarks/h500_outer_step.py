"""Where H = 500's first rounds go (issue 36; docs/reproduction.md §11): the outer step or the average.

Every tuning run of reproduce_diloco.py's part H500 at H = 500 first rises far above its warm
start, while every H = 50 run is below its start at its first evaluation (the same 500 steps, 10
of its rounds). Two readings: the average of k workers 500 steps apart is a bad model, or the
outer Nesterov step lands past the average: (1 + momentum) × the outer lr × the average
outer_grad at its first step (1.9× at momentum 0.9, lr 1), and its momentum carries that into
the next (lr × (1.9 g2 + 0.81 g1)). This runs H = 500's tuning pick (seed 100, tuning split,
k = 4, its inner lr and warm-up, from reproduce_diloco_H500.json) again, evaluating after every
round, in two arms:

- `nesterov`: as tuned;
- `average`: outer SGD at lr 1 without momentum, so the global model is the workers' average.

Each arm is `diloco train` with reproduce_diloco.py's command for that run (its `Ctx._attempt`),
stopped after the round `--arms` gives it (`--stop-after`; 20: the whole run; the inner lr keeps
its 10,000-step schedule either way). The arms run at once, one thread each, after the tuning
seed's pretraining (~2.5 min, once per workdir): ~25 min for 3 rounds each beside the lane, a
whole run 1.5-2 h. A folder that got as far is reused (its curve cut at the arm's rounds), one
with an earlier checkpoint resumed. JSON: benchmarks/results/h500_outer_step.json, one entry per
arm (its curve, `peak` as in part H500's JSON, the run's wall time; a whole run's `val_loss`
against both picks'); an invocation replaces the entries of the arms it runs and keeps the
others. `ledger_curve` is the tuned run's ledger curve beside the nesterov arm's: where the
ledger's run was made on another machine, whose kernels round differently in the last bits, the
two agree at the start and drift apart (`vs_ledger_max_rel`) as H = 500's first rounds amplify it.

    python benchmarks/h500_outer_step.py [--arms nesterov:3,average:20] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
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
    """reproduce_diloco's context at its defaults (nano, 3 seeds: as its lane runs part H500), with
    the ledger in git (read only) and run folders in `workdir`."""
    return rd.Ctx(rd.parse_args(["--workdir", str(workdir)]))


def make_arms(ctx: rd.Ctx, pick: dict) -> dict[str, rd.Run]:
    """The two arms at H = 500's tuning pick (`pick`: its entry in reproduce_diloco_H500.json)."""
    common = dict(k=rd.K, H=H, warm=True, fair=True, tuning=True, steps=rd.H500_STEPS)
    common.update(inner_lr=pick["inner_lr"], warmup=pick["warmup"])
    return {
        "nesterov": ctx.diloco(rd.TUNE_SEED, lr=pick["outer_lr"], **common),
        "average": ctx.diloco(rd.TUNE_SEED, lr=1.0, opt="sgd", momentum=0.0, **common),
    }


def _train(ctx: rd.Ctx, run: rd.Run, rounds: int | None = None) -> bool:
    """`diloco train` for `run` up to round `rounds` (None: the whole run) through reproduce_diloco's
    `Ctx._attempt` (one thread, its environment). A folder that has got that far is reused (False),
    one with an earlier checkpoint resumes from it (bit for bit; a checkpoint `diloco train` cannot
    read starts the run over), any other starts afresh; exits naming the run on failure."""
    from diloco.rundir import checkpoint

    d = ctx.dir(run)
    done = checkpoint.rounds(d / "checkpoints") if (d / "checkpoints").is_dir() else []
    if (d / "summary.json").is_file() or (rounds is not None and done and done[-1] >= rounds):
        return False
    proc, _ = ctx._attempt(run, bool(done), rounds)
    if done and proc.returncode == 2:
        _log(f"{run.label}: its checkpoint cannot be resumed ({proc.stderr.strip()[-200:]}); starting over")
        proc, _ = ctx._attempt(run, False, rounds)
    if proc.returncode != 0:
        sys.exit(f"h500_outer_step: {run.label} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return True


def arm_entry(ctx: rd.Ctx, run: rd.Run, rounds: int, dp_loss: float, tuned_loss: float) -> dict:
    """An arm's JSON entry from its folder, up to round `rounds` (a folder that ran further is cut
    there): its evaluation curve, `peak`, the run's own wall time to there and, for a whole run,
    its final loss on the tuning split against both picks'."""
    d = ctx.dir(run)
    evals = [e for e in ctx.evals(run.name) or [] if e["inner_step"] <= rounds * H]
    xs, ys = [e["inner_step"] for e in evals], [e["val_loss"] for e in evals]
    summary = d / "summary.json"
    whole = rounds == rd.H500_STEPS // H and summary.is_file()
    loss = json.loads(summary.read_text())["val_loss"] if whole else None
    return {
        "outer": {f: run.flags[run.flags.index(f) + 1] for f in OUTER_FLAGS if f in run.flags},
        "run": run.name,
        "rounds": rounds,
        "curve": [[x, round(y, 5)] for x, y in zip(xs, ys, strict=True)],
        "peak": rd.peak(xs, ys),
        "val_loss": loss,  # a whole run's, on the tuning split (as lr_grid_tuning's)
        "vs_dp_pick": round(loss / dp_loss - 1, 4) if loss else None,
        "vs_tuned_pick": round(loss / tuned_loss - 1, 4) if loss else None,
        # the run's wall time to its last evaluation here, over its attempts (beside the lane)
        "wall_time_s": evals[-1]["wall_time_s"] if evals else None,
    }


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
    if not args.arms:
        ap.error("--arms names no arm")
    if bad := {a: n for a, n in args.arms.items() if not 1 <= n <= whole}:
        ap.error(f"an arm's rounds must be 1 to {whole}, got {bad}")
    h500 = json.loads(H500.read_text())
    pick, dp = h500["by_H"][str(H)], h500["dp"]["tuning"]
    if pick.get("outer_lr") is None or pick.get("inner_lr") is None or dp.get("lr") is None:
        sys.exit(f"h500_outer_step: {H500.name} has no picks yet; run part H500's tuning first")
    dp_loss = dp["grid"][rd._num(dp["lr"])]  # data parallel's pick on the tuning split
    tuned_loss = pick["lr_grid_tuning"][rd._num(pick["outer_lr"])]  # the nesterov pick's whole run
    ctx = _ctx(args.workdir)
    every = make_arms(ctx, pick)
    arms, tuned = {name: every[name] for name in args.arms}, every["nesterov"]
    row = ctx.ledger.rows.get(tuned.name)
    if row is None or not row.get("curve"):
        sys.exit(f"h500_outer_step: the ledger has no curve for {tuned.name}; merge the lane's ledger")
    if not (ctx.dir(tuned.init) / "summary.json").is_file():  # a pretraining run made before is reused
        _log(f"pretraining {tuned.init.label} in {args.workdir}")
        _train(ctx, tuned.init)
    _log(f"at once: {', '.join(f'{a} {n} rounds' for a, n in args.arms.items())}")

    def run_arm(name: str) -> bool:
        return _train(ctx, arms[name], None if args.arms[name] == whole else args.arms[name])

    with ThreadPoolExecutor(len(arms)) as pool:
        list(pool.map(run_arm, arms))
    setting = {"seed": rd.TUNE_SEED, "split": "tuning", "k": rd.K, "H": H, "steps_per_worker": rd.H500_STEPS}
    setting.update(inner_lr=pick["inner_lr"], warmup=pick["warmup"])
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if {k: result.get(k) for k in setting} != setting:
        result = {}  # another pick: the arms run before are not comparable
    result = {"benchmark": "h500_outer_step", **setting, "arms": result.get("arms", {})}
    for name, run in arms.items():
        result["arms"][name] = arm_entry(ctx, run, args.arms[name], dp_loss, tuned_loss)
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
