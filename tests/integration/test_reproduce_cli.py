"""benchmarks/reproduce_diloco.py's command line, run for real: bad part-H settings exit 2 before
anything is written, and `--h-k` plans part H alone at that k. `--report-only` on an empty
workdir starts no run, so this takes seconds (the runs themselves are the benchmark's job)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import benchmark_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "reproduce_diloco.py"


def _run(tmp_path: Path, *args: str, out: str = "out.json") -> subprocess.CompletedProcess:
    where = ["--workdir", str(tmp_path / "runs"), "--ledger", str(tmp_path / "ledger")]
    where += ["--out", str(tmp_path / out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, *where],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--part", "H", "--h-k", "0"], "--h-k must be ≥ 1"),
        (["--part", "dp", "--h-k", "8"], "give --part H alone"),
        (["--part", "H", "--hs", "7"], "multiples of every H"),  # 1,000 steps are not 7s
        (["--part", "H", "--hs", "0"], "each ≥ 1"),
        (["--part", "dp", "--lr-grid=0,0.7"], "give learning rates above 0"),  # DiLoCo's grids start there
    ],
)
def test_bad_part_H_settings_exit_2_and_write_nothing(tmp_path, args, message):
    p = _run(tmp_path, "--report-only", *args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_h_k_plans_part_H_alone_at_that_k(tmp_path):
    p = _run(tmp_path, "--report-only", "--part", "H", "--h-k", "8", "--hs", "10")
    assert p.returncode == 0, p.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    parts = {"dp", "single", "workers", "H", "outer", "shards", "drop", "schedule", "codec"}
    assert parts & set(out) == {"H"}  # the other parts stay the default JSON's
    # H = 10 and the baseline H = 50, and data parallel at k = 8: 3 seeds each, none run yet
    assert out["H"] == {"status": "not run", "runs_planned": 9}
    # the default JSON's name covers every part; another name only the parts it names
    default = _run(tmp_path, "--report-only", "--part", "H", "--hs", "10", out="reproduce_diloco.json")
    assert default.returncode == 0, default.stderr
    assert parts <= set(json.loads((tmp_path / "reproduce_diloco.json").read_text()))
    other = _run(tmp_path, "--report-only", "--part", "H", "--hs", "10")
    assert other.returncode == 0, other.stderr
    assert parts & set(json.loads((tmp_path / "out.json").read_text())) == {"H"}


def _module():
    return benchmark_module("reproduce_diloco")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("h_k", [4, 8])
def test_part_H_runs_diloco_and_data_parallel_at_h_k(tmp_path, h_k):
    mod = _module()
    args = argparse.Namespace(
        quick=False, ks=(4, 8), starts=("scratch",), lr_grid=(0.7,), serial_ks=(), model="nano",
        steps=1000, H=50, hs=(10, 50), h_k=h_k, seeds=2, pretrain_steps=1000, jobs=1,
        workdir=tmp_path, ledger=tmp_path / "runs.jsonl",
    )  # fmt: skip
    ctx = mod.Ctx(args)
    plan, _ = mod.part_H(ctx)
    runs = plan.all_runs(ctx)
    assert len(runs) == 6  # (H = 10, H = 50, data parallel) × 2 seeds, each once
    for r in runs:
        flags = list(r.flags)
        assert flags[flags.index("--workers") + 1] == str(h_k), r.label
    assert sorted(r.label for r in runs if "--method" in r.flags and "dp" in r.flags) == [
        f"dp k={h_k} s0",
        f"dp k={h_k} s1",
    ]


def _ctx(mod, tmp_path, **kw):
    args = argparse.Namespace(
        quick=False, ks=(4,), starts=("warm",), lr_grid=(0.7, 1.0), serial_ks=(4,), model="nano",
        steps=1000, H=50, hs=(50,), h_k=4, seeds=3, pretrain_steps=1000, jobs=1,
        workdir=tmp_path, ledger=tmp_path / "runs.jsonl", **kw,
    )  # fmt: skip
    return mod.Ctx(args)


def _flag(run, name):
    flags = list(run.flags)
    return flags[flags.index(name) + 1] if name in flags else None


@pytest.mark.timeout(60)
def test_part_dp_tunes_every_arm_on_the_tuning_seed_and_split_only(tmp_path):
    """Issue 36's rules: every run of part dp holds the tuning split out; the grids (data
    parallel's and single's inner lr × warm-up, DiLoCo's inner lr then outer lr) run on the tuning seed and
    score the tuning split; nothing run on a reported seed scores it."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    plan, _ = mod.part_dp(ctx)
    grids = list({r.name: r for t in plan.tuned for r in t.grid_runs(ctx)}.values())  # serial: single's
    assert len(grids) == 2 * 4 + 2 * 4  # dp and single: 4 lrs × 2 warm-ups; DiLoCo waits for single's pick
    for r in grids:
        assert r.seed == mod.TUNE_SEED and _flag(r, "--eval-on") == "tune", r.label
        assert _flag(r, "--tune-fraction") == "0.05" and _flag(r.init, "--tune-fraction") == "0.05"
    lrs = {
        (_flag(r, "--inner-lr"), _flag(r, "--warmup-steps")) for r in grids if _flag(r, "--method") == "dp"
    }
    assert lrs == {(lr, w) for lr in ("0.0005", "0.001", "0.002", "0.004") for w in ("30", "100")}
    assert not [r for r in plan.all_runs(ctx) if r.seed != mod.TUNE_SEED and "--eval-on" in r.flags]


@pytest.mark.timeout(60)
def test_a_choice_picks_the_best_warmup_and_lr_then_runs_the_reported_seeds(tmp_path):
    """Data parallel's tuning losses by hand: warm-up 100 at lr 2e-3 is best (1.5), inside its
    grid; warm-up 30's best, 4e-3, is on its edge, so its grid widens to 8e-3 first, which is
    worse (1.9). The pick is then run on seeds 0, 1, 2, and part H500's data parallel re-tunes
    around it (÷2, ×1, ×2) at its own steps."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    _, dp, _ = mod.dp_arms(ctx, 4, True)
    losses = {
        30: {5e-4: 2.4, 1e-3: 2.2, 2e-3: 2.0, 4e-3: 1.8, 8e-3: 1.9},
        100: {5e-4: 2.3, 1e-3: 1.9, 2e-3: 1.5, 4e-3: 1.7},
    }
    rows = []
    for w, by_lr in losses.items():
        t = dp.options[f"warmup {w}"]
        for lr, v in by_lr.items():
            r = t.tune(lr)
            rows.append(
                {"name": r.name, "label": r.label, "flags": list(r.flags), "summary": {"val_loss": v}}
            )
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = _ctx(mod, tmp_path)
    _, dp, _ = mod.dp_arms(ctx, 4, True)
    assert dp.options["warmup 30"].grid(ctx) == (5e-4, 1e-3, 2e-3, 4e-3, 8e-3)
    assert dp.pick(ctx) == "warmup 100" and mod._picked(dp, ctx) == (2e-3, 100)
    runs = dp.runs(ctx)
    assert [r.seed for r in runs] == [0, 1, 2]
    assert {(_flag(r, "--inner-lr"), _flag(r, "--warmup-steps"), _flag(r, "--eval-on")) for r in runs} == {
        ("0.002", "100", None)
    }
    plan, _ = mod.part_H500(ctx)
    around = plan.tuned[0]  # H500's data parallel re-tunes around the pick at 10,000 steps
    new = [r for r in around.grid_runs(ctx) if _flag(r, "--rounds") == "200"]  # H = 50
    assert [
        (_flag(r, "--inner-lr"), _flag(r, "--warmup-steps"), r.seed, _flag(r, "--eval-on")) for r in new
    ] == [(lr, "100", mod.TUNE_SEED, "tune") for lr in ("0.001", "0.002", "0.004")]
    assert around.runs(ctx) == []  # until its own grid has run


@pytest.mark.timeout(60)
def test_an_inner_lr_grid_widens_up_to_three_times_past_its_edge(tmp_path):
    """Data parallel's loss falls with every lr up to 3.2e-2 (the third widening), and further
    still: the grid stops at 3.2e-2 and says its pick is on the edge."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    _, dp, _ = mod.dp_arms(ctx, 4, True)
    t = dp.options["warmup 30"]
    lrs = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2)
    (tmp_path / "runs.jsonl").write_text(_rows([(t.tune(lr), 2.0 - 0.1 * i) for i, lr in enumerate(lrs)]))
    ctx = _ctx(mod, tmp_path)
    _, dp, _ = mod.dp_arms(ctx, 4, True)
    t = dp.options["warmup 30"]
    assert t.grid(ctx) == lrs[:-1] and t.best(ctx) == 3.2e-2 and t.at_edge(ctx)


@pytest.mark.timeout(60)
def test_a_run_marked_to_run_again_keeps_its_ledger_row_if_it_fails(tmp_path):
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    run = ctx.dp(4, 0, True)
    row = {"name": run.name, "label": run.label, "flags": list(run.flags), "summary": {"val_loss": 1.75}}
    (tmp_path / "runs.jsonl").write_text(json.dumps(row) + "\n")
    ctx = _ctx(mod, tmp_path)
    assert ctx.finished(run)
    ctx.rerun.add(run.name)
    assert not ctx.finished(run)  # the scheduler runs it again
    (tmp_path / run.name).mkdir()
    (tmp_path / run.name / "failed.json").write_text(json.dumps({"returncode": 1}))
    ctx.keep(run)
    assert ctx.ledger.rows[run.name]["summary"] == {"val_loss": 1.75}


@pytest.mark.timeout(60)
def test_a_choice_whose_one_option_failed_whole_picks_the_other(tmp_path):
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    _, dp, _ = mod.dp_arms(ctx, 4, True)
    rows = []
    for w, fail in ((30, True), (100, False)):
        for lr, v in zip(mod.INNER_LR_GRID, (2.3, 1.9, 2.0, 2.1), strict=True):
            r = dp.options[f"warmup {w}"].tune(lr)
            row = {"name": r.name, "label": r.label, "flags": list(r.flags)}
            rows.append({**row, "failed": {"returncode": 1}} if fail else {**row, "summary": {"val_loss": v}})
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = _ctx(mod, tmp_path)
    _, dp, _ = mod.dp_arms(ctx, 4, True)
    assert dp.pick(ctx) == "warmup 100" and mod._picked(dp, ctx) == (1e-3, 100)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("signal_name", "code"), [("SIGTERM", -15), ("SIGKILL", -9), ("SIGHUP", -1)])
def test_a_run_whose_process_a_signal_kills_leaves_no_result(tmp_path, signal_name, code):
    """A stopped lane's run (SIGTERM, SIGKILL as a session's end sends, SIGHUP; Ctrl-C too) is not
    a failed run: nothing in its folder or the ledger, so a restart runs it again (from its
    checkpoint, which stays); a crash (abort) is recorded as failed."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    run = ctx.dp(4, 0, True)
    kill = f"import os, signal; os.kill(os.getpid(), signal.{signal_name})"
    ctx.command = lambda run, resume=False, stop_after=None: [sys.executable, "-c", kill]
    (ctx.dir(run) / "checkpoints" / "round-000002").mkdir(parents=True)
    with pytest.raises(mod.Stopped, match=rf"stopped \(exit code {code}\)"):
        ctx.train(run)
    assert not ctx.finished(run) and not (tmp_path / run.name / "failed.json").exists()
    assert (ctx.dir(run) / "checkpoints" / "round-000002").is_dir()
    assert not _ctx(mod, tmp_path).finished(run)  # a restart reads the ledger: nothing there
    crash = "import os; os.abort()"  # a crash is a result: failed, with its stderr
    ctx.command = lambda run, resume=False, stop_after=None: [sys.executable, "-c", crash]
    assert ctx.train(run)[0] is False and ctx.finished(run)
    assert json.loads((tmp_path / run.name / "failed.json").read_text())["returncode"] == -6


def _quick_ctx(mod, workdir: Path):
    """`--quick`'s context (a tiny model: seconds a run), its config written as main() does."""
    args = argparse.Namespace(
        quick=True, ks=(4,), starts=("warm",), lr_grid=(0.7,), serial_ks=(4,), model="nano",
        steps=mod.QUICK_STEPS, H=mod.QUICK_H, hs=(mod.QUICK_H,), h_k=4, seeds=1,
        pretrain_steps=mod.QUICK_STEPS, jobs=1, workdir=workdir, ledger=workdir / "runs.jsonl",
    )  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mod.Ctx(args)
    ctx.config_path.write_text(mod.QUICK_CONFIG)
    return ctx


def _arm(ctx, arm: str):
    """One quick run of each kind the lanes start: 4 rounds of 10 steps."""
    if arm == "single":
        return ctx.single(0, steps=40)
    if arm == "dp":
        return ctx.dp(2, 0, steps=40)
    extra = ("--codec", "topk", "--error-feedback", "--topk-fraction", "0.1", "--topk-chunk", "64")
    if arm == "sparseloco":
        return ctx.diloco(0, k=2, H=10, steps=40, opt="sparseloco", extra=(*extra, "--topk-bits", "2"))
    return ctx.diloco(0, k=2, H=10, steps=40)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arm", ["diloco", "sparseloco", "dp", "single"])
def test_a_run_stopped_after_a_checkpoint_resumes_from_it_to_the_same_result(tmp_path, arm):
    """A lane stopped mid-run (here the run's first attempt stops after round 2 of 4, leaving a
    checkpoint and no summary) continues from its checkpoint to the run made in one go without
    checkpoints (as the ledger's older rows were made), bit for bit: the same model and the same
    evaluation curve; its checkpoints are deleted and the ledger row says it was resumed."""
    mod = _module()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    plain, ctx = _quick_ctx(mod, tmp_path / "plain"), _quick_ctx(mod, tmp_path / "lane")
    run = _arm(ctx, arm)
    cmd = ctx.command(run)
    i = cmd.index("--checkpoint-every")
    assert cmd[i : i + 4] == ["--checkpoint-every", "1", "--keep-checkpoints", "1"]  # 4 rounds: every round
    assert "--checkpoint-every" not in run.flags  # not part of the run's name
    cmd = [*cmd[:i], *cmd[i + 4 :]]
    cmd[cmd.index("--out") + 1] = str(plain.dir(run))
    whole = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0, whole.stderr
    first = subprocess.run(ctx.command(run, stop_after=2), env=env, capture_output=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert not (ctx.dir(run) / "summary.json").exists()
    assert (ctx.dir(run) / "checkpoints" / "round-000002").is_dir()
    ok, elapsed = ctx.train(run)
    assert ok and not (ctx.dir(run) / "checkpoints").exists()
    bench = json.loads((ctx.dir(run) / "bench.json").read_text())
    assert "--resume" in bench["resumed"]["cmd"] and "--resume" not in bench["cmd"]
    summary = json.loads((ctx.dir(run) / "summary.json").read_text())
    assert elapsed == bench["elapsed_s"] >= summary["wall_time_s"]  # the work of both attempts
    assert ctx.ledger.rows[run.name]["resumed"] is True
    model = (ctx.dir(run) / "model.safetensors").read_bytes()
    assert model == (plain.dir(run) / "model.safetensors").read_bytes()
    assert ctx.curve(run.name) == plain.curve(run.name) and len(ctx.curve(run.name)[0]) >= 2


@pytest.mark.timeout(180)
def test_a_resume_that_diloco_refuses_starts_the_run_over(tmp_path, capsys):
    """A folder whose checkpoint cannot be read (garbage here: `diloco train --resume` exits 2)
    does not become a failed run: the run starts over in an emptied folder, and its record keeps
    why the resume was refused."""
    mod = _module()
    ctx = _quick_ctx(mod, tmp_path)
    run = ctx.single(0, steps=20)
    junk = ctx.dir(run) / "checkpoints" / "round-000001"
    junk.mkdir(parents=True)
    (junk / "state.json").write_text("not a checkpoint")
    ok, _ = ctx.train(run)
    bench = json.loads((ctx.dir(run) / "bench.json").read_text())
    assert ok and "resumed" not in bench and bench["resume_refused"]["returncode"] == 2
    assert "resumed" not in ctx.ledger.rows[run.name]
    assert ctx.result(run)["inner_steps"] == 20
    assert "its resume was refused" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_resumed_run_that_fails_in_training_is_failed_not_run_again(tmp_path):
    """Exit code 3 (the run failed: diverged) after a resume is the run's result: recorded as
    failed once, not started over (it would fail again after hours), its checkpoints deleted."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    run = ctx.dp(4, 0, True)
    (ctx.dir(run) / "checkpoints" / "round-000003").mkdir(parents=True)
    log = tmp_path / "attempts.txt"
    script = f"import sys; open({str(log)!r}, 'a').write(sys.argv[1] + chr(10)); sys.exit(3)"
    ctx.command = lambda run, resume=False, stop_after=None: [
        sys.executable,
        "-c",
        script,
        "resume" if resume else "fresh",
    ]
    assert ctx.train(run)[0] is False
    assert log.read_text().split() == ["resume"]  # one process: not started over
    failed = json.loads((ctx.dir(run) / "failed.json").read_text())
    assert failed["returncode"] == 3 and "resume_refused" not in failed
    assert not (ctx.dir(run) / "checkpoints").exists() and "failed" in ctx.ledger.rows[run.name]


def _settings(run, *names: str) -> tuple:
    """A run's seed and the values of the flags named."""
    return (run.seed, *(_flag(run, name) for name in names))


def _rows(runs_losses) -> str:
    """Ledger rows for (run, val_loss) pairs: finished runs as the ledger holds them."""
    rows = [
        {"name": r.name, "label": r.label, "flags": list(r.flags), "summary": {"val_loss": v}}
        for r, v in runs_losses
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


def _single_picks_2e3_at_warmup_100(mod, ctx) -> list:
    """Single's tuning losses: warm-up 100 at inner lr 2e-3 is best (1.6), inside its grid."""
    single, _, _ = mod.dp_arms(ctx, 4, True)
    losses = {
        30: {5e-4: 2.4, 1e-3: 2.2, 2e-3: 2.0, 4e-3: 2.1},
        100: {5e-4: 2.3, 1e-3: 1.9, 2e-3: 1.6, 4e-3: 1.7},
    }
    return [
        (single.options[f"warmup {w}"].tune(lr), v) for w, by_lr in losses.items() for lr, v in by_lr.items()
    ]


def _write(tmp_path, mod, *rows):
    """The ledger holds these (run, val_loss) rows; a fresh context reads it."""
    (tmp_path / "runs.jsonl").write_text(_rows([r for part in rows for r in part]))
    return _ctx(mod, tmp_path)


def _diloco_picks_1e3_then_outer_1(mod, ctx) -> list:
    """Part dp's DiLoCo (k = 4, H = 50, warm) tuning losses, single having picked 2e-3 at warm-up
    100: its inner-lr grid at outer lr 0.7 is best at 1e-3 (not single's 2e-3), inside; its outer
    grid at 1e-3 (0.7, 1.0: 0.7 is the inner grid's run) is best at 1.0 on the edge, widened to
    1.4 (worse): outer 1.0."""
    _, _, diloco = mod.dp_arms(ctx, 4, True)
    inner = diloco[50].inner_grid(ctx)
    rows = [(inner.tune(lr), v) for lr, v in {5e-4: 1.9, 1e-3: 1.7, 2e-3: 1.75, 4e-3: 1.85}.items()]
    rows += [(diloco[50].tune(lr, 1e-3, 100), v) for lr, v in {1.0: 1.65, 1.4: 1.68}.items()]
    return rows


@pytest.mark.timeout(60)
def test_diloco_tunes_its_inner_lr_at_the_paper_outer_lr_then_its_outer_lr_at_that_pick(tmp_path):
    """DiLoCo's two lrs get grids of their own, one after the other, on the tuning seed and split:
    its inner-lr grid waits for single's warm-up (100 here) and runs at the paper's outer lr 0.7;
    its outer-lr grid then runs at its own inner pick (1e-3, not single's 2e-3), sharing the 0.7
    run, widening at an edge; the reported seeds run at both picks. The report records both
    grids, and the earlier rules' runs the ledger has as ablations."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    _, _, diloco = mod.dp_arms(ctx, 4, True)
    assert diloco[50].inner_grid(ctx) is None and diloco[50].runs(ctx) == []  # single's grid has not run
    single = _single_picks_2e3_at_warmup_100(mod, ctx)
    old = [(ctx.diloco(mod.TUNE_SEED, k=4, H=50, lr=0.7, warm=True, fair=True, tuning=True), 1.74)]
    old += [(ctx.diloco(mod.TUNE_SEED, k=4, H=50, lr=1.0, warm=True, fair=True, tuning=True), 1.71)]
    at_single = [  # stop 64's rule: DiLoCo at single's inner settings (a point of the inner grid below)
        (ctx.diloco(mod.TUNE_SEED, k=4, H=50, lr=0.7, warm=True, fair=True, tuning=True, inner_lr=2e-3,
                    warmup=100), 1.75)
    ]  # fmt: skip
    ctx = _write(tmp_path, mod, single, old, at_single)
    _, _, diloco = mod.dp_arms(ctx, 4, True)
    named = ("--outer-lr", "--inner-lr", "--warmup-steps", "--eval-on", "--tune-fraction")
    assert diloco[50].inner(ctx) is None  # its inner grid has not run
    assert [_settings(r, *named) for r in diloco[50].grid_runs(ctx)[8:]] == [
        (mod.TUNE_SEED, "0.7", lr, "100", "tune", "0.05") for lr in ("0.0005", "0.001", "0.002", "0.004")
    ]  # after single's 8
    assert [ctx.finished(r) for r in diloco[50].grid_runs(ctx)[8:]] == [
        False,
        False,
        True,
        False,
    ]  # 2e-3: stop 64's
    mine = _diloco_picks_1e3_then_outer_1(mod, ctx)
    ctx = _write(tmp_path, mod, single, old, at_single, mine[:4])
    _, _, diloco = mod.dp_arms(ctx, 4, True)
    assert diloco[50].picked(ctx) == (1e-3, 100)
    outer = diloco[50].inner(ctx).grid_runs(ctx)
    assert [_settings(r, *named) for r in outer] == [
        (mod.TUNE_SEED, lr, "0.001", "100", "tune", "0.05") for lr in ("0.7", "1")
    ]
    assert outer[0].name == diloco[50].inner_grid(ctx).tune(1e-3).name  # one run, two grids
    ctx = _write(tmp_path, mod, single, old, at_single, mine[:5])
    _, _, diloco = mod.dp_arms(ctx, 4, True)
    assert diloco[50].inner(ctx).grid(ctx) == (0.7, 1.0, 1.4) and diloco[50].runs(ctx) == []  # widens
    ctx = _write(tmp_path, mod, single, old, at_single, mine)
    _, _, diloco = mod.dp_arms(ctx, 4, True)
    assert diloco[50].best(ctx) == 1.0 and diloco[50].at_edge(ctx) is False
    assert [_settings(r, *named) for r in diloco[50].runs(ctx)] == [
        (s, "1", "0.001", "100", None, "0.05") for s in (0, 1, 2)
    ]  # the reported seeds, at DiLoCo's own picks, scored on the validation split
    _, report = mod.part_dp(ctx)
    tuning = report()["tuning"]
    arm = tuning["arms"]["diloco k=4 H=50 warm"]
    assert arm["inner_grid"] == {"0.0005": 1.9, "0.001": 1.7, "0.002": 1.75, "0.004": 1.85}
    assert (arm["inner_grid_at_outer_lr"], arm["inner_lr"], arm["warmup"]) == (0.7, 1e-3, 100)
    assert (arm["grid"], arm["pick"], arm["lr_at_grid_edge"]) == (
        {"0.7": 1.7, "1": 1.65, "1.4": 1.68},
        1.0,
        False,
    )
    # the earlier rules' runs that fed no pick: not the inner grid's 2e-3 point (stop 64's run)
    assert tuning["ablations"] == {"diloco k=4 H=50 warm, inner lr 1e-3 wu 30": {"0.7": 1.74, "1": 1.71}}


@pytest.mark.timeout(60)
def test_single_one_grid_point_below_its_pick_runs_on_the_reported_seeds_as_an_ablation(tmp_path):
    """Part dp's ablation of single's pick: nothing until single has picked (2e-3 at warm-up 100),
    then single at 1e-3 (÷2), warm-up 100, 1,000 steps, on the reported seeds, scored on the
    validation split; the report gives its loss apart from single's row."""
    mod = _module()

    def ablation(ctx):
        plan, report = mod.part_dp(ctx)
        runs = [r for t in plan.tuned if isinstance(t, mod.Follow) for r in t.runs(ctx)]
        return [r for r in runs if _flag(r, "--rounds") == "20"], report  # not the serial 4,000 steps

    assert ablation(_ctx(mod, tmp_path))[0] == []  # single has not picked
    single = _single_picks_2e3_at_warmup_100(mod, _ctx(mod, tmp_path))
    below, _ = ablation(_write(tmp_path, mod, single))
    named = ("--method", "--inner-lr", "--warmup-steps", "--eval-on")
    assert [_settings(r, *named) for r in below] == [(s, "single", "0.001", "100", None) for s in (0, 1, 2)]
    _write(tmp_path, mod, single)
    with (tmp_path / "runs.jsonl").open("a") as f:  # a reported run's row has its bytes and steps
        for r, v in zip(below, (1.8, 2.0, 2.2), strict=True):
            summary = {"val_loss": v, "bytes_sent_per_worker": 0, "inner_steps": 1000}
            f.write(
                json.dumps({"name": r.name, "label": r.label, "flags": list(r.flags), "summary": summary})
            )
            f.write("\n")
    row = ablation(_ctx(mod, tmp_path))[1]()["per_k"]["4"]
    lower = row["warm"]["single_lr_below"]
    assert (lower["lr"], lower["warmup"], lower["per_seed"]) == (1e-3, 100, {"0": 1.8, "1": 2.0, "2": 2.2})
    assert row["single_warm_lr_below_final_val_loss"] == pytest.approx(2.0)
    assert row["warm"]["single"]["val_loss"] is None  # single's own reported seeds have not run
    assert row["diloco_warm_vs_single_lr_below_gap"] is None  # nor DiLoCo's


@pytest.mark.timeout(60)
def test_data_parallel_one_grid_point_below_its_pick_runs_from_scratch_only(tmp_path):
    """From scratch, data parallel too gets the ablation below its pick (k = 4 picks 2e-3 at
    warm-up 100: its ablation runs at 1e-3 with a 4× batch on the reported seeds); the report has
    it and DiLoCo's gap to it (none before DiLoCo has run). From the warm start it has none."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    ctx.dp_starts = ("scratch",)
    _, dp, _ = mod.dp_arms(ctx, 4, False)
    losses = {
        30: {5e-4: 2.4, 1e-3: 2.2, 2e-3: 2.0, 4e-3: 2.1},
        100: {5e-4: 2.3, 1e-3: 1.9, 2e-3: 1.5, 4e-3: 1.7},
    }
    rows = [(dp.options[f"warmup {w}"].tune(lr), v) for w, by_lr in losses.items() for lr, v in by_lr.items()]
    ctx = _write(tmp_path, mod, rows)
    ctx.dp_starts = ("scratch",)
    plan, report = mod.part_dp(ctx)
    runs = [r for t in plan.tuned if isinstance(t, mod.Follow) for r in t.runs(ctx)]
    named = ("--method", "--workers", "--inner-lr", "--warmup-steps", "--eval-on")
    assert [_settings(r, *named) for r in runs] == [(s, "dp", "4", "0.001", "100", None) for s in (0, 1, 2)]
    assert all(r.init is None for r in runs)  # from scratch
    row = report()["per_k"]["4"]
    assert row["scratch"]["dp_lr_below"]["lr"] == 1e-3 and row["scratch"]["dp_lr_below"]["runs"] == [
        r.name for r in runs
    ]
    assert (
        row["dp_scratch_lr_below_final_val_loss"] is None and row["diloco_scratch_vs_dp_lr_below_gap"] is None
    )
    ctx.dp_starts = ("warm",)
    plan, report = mod.part_dp(ctx)
    assert "dp_lr_below" not in report()["per_k"]["4"]["warm"]


@pytest.mark.timeout(60)
def test_diloco_inner_grid_runs_at_the_outer_grid_point_nearest_the_paper_outer_lr(tmp_path):
    """With --lr-grid 0.5,1 (no 0.7) the inner-lr grid runs at 0.5, so its pick is a point of the
    outer grid too; `--pending` counts the outer grid's other points and the seeds, at single's
    warm-up, once the inner grid is made."""
    mod = _module()
    ctx = _write(tmp_path, mod, _single_picks_2e3_at_warmup_100(mod, _ctx(mod, tmp_path)))
    ctx.dp_lr_grid = (0.5, 1.0)
    _, _, diloco = mod.dp_arms(ctx, 4, True)
    inner = diloco[50].inner_grid(ctx).grid_runs(ctx)
    assert {_settings(r, "--outer-lr", "--warmup-steps") for r in inner} == {(mod.TUNE_SEED, "0.5", "100")}
    future = mod._future(diloco[50], ctx)
    assert [_settings(r, "--outer-lr", "--inner-lr", "--warmup-steps") for r in future] == [
        (mod.TUNE_SEED, "0.5", "0.004", "100"),  # the inner grid's 4e-3 run: one run, two grids
        (mod.TUNE_SEED, "1", "0.004", "100"),
        *[(s, "0.5", "0.004", "100") for s in (0, 1, 2)],
    ]
    assert future[0].name == inner[-1].name


@pytest.mark.timeout(60)
def test_diloco_at_the_default_inner_settings_keeps_the_name_of_its_runs_before_issue_36(tmp_path):
    """DiLoCo ran at `diloco train`'s default inner lr and warm-up before its inner lr had a grid:
    the grid's run at those settings is the same command, so it has the same name (and ledger
    row); any other setting is named by its flags."""
    from diloco.config.sections import InnerConfig

    mod = _module()
    ctx = _ctx(mod, tmp_path)
    assert mod.DEFAULT_INNER == (InnerConfig().lr, InnerConfig().warmup_steps)
    plain = ctx.diloco(mod.TUNE_SEED, k=4, H=50, lr=0.7, warm=True, fair=True, tuning=True)
    same = ctx.diloco(
        mod.TUNE_SEED, k=4, H=50, lr=0.7, warm=True, fair=True, tuning=True, inner_lr=1e-3, warmup=30
    )
    other = ctx.diloco(
        mod.TUNE_SEED, k=4, H=50, lr=0.7, warm=True, fair=True, tuning=True, inner_lr=1e-3, warmup=100
    )
    assert same == plain and "--inner-lr" not in same.flags
    assert other.name != plain.name and _settings(other, "--inner-lr", "--warmup-steps")[1:] == (
        "0.001",
        "100",
    )


@pytest.mark.timeout(60)
def test_part_H500_centres_each_H_grids_on_part_dp_diloco_picks(tmp_path):
    """Part dp's DiLoCo (k = 4, warm) picked inner lr 1e-3 at warm-up 100 and outer lr 1.0. Part
    H500 at each H first re-tunes its inner lr over 1e-3 ÷/× 2 at outer lr 1.0 (at its own steps,
    on the tuning seed and split; at H = 500, 2e-3 is best on the edge and the grid widens to
    4e-3, worse), then its outer lr over 1.0 ÷/× 1.4 at that pick; nothing before part dp's picks."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    plan, _ = mod.part_H500(ctx)
    dp10k, *by_H = plan.tuned
    assert [t.inner_grid(ctx) for t in by_H] == [None, None]  # part dp's grids have not run
    single = _single_picks_2e3_at_warmup_100(mod, ctx)
    ctx = _write(tmp_path, mod, single)
    part_dp = _diloco_picks_1e3_then_outer_1(mod, ctx)
    ctx = _write(tmp_path, mod, single, part_dp[:4])
    plan, _ = mod.part_H500(ctx)
    assert [t.inner_grid(ctx) for t in plan.tuned[1:]] == [None, None]  # part dp's outer lr not picked
    ctx = _write(tmp_path, mod, single, part_dp)
    plan, report = mod.part_H500(ctx)
    dp10k, *by_H = plan.tuned
    named = ("--outer-lr", "--inner-lr", "--warmup-steps", "--eval-on", "--rounds")
    for arm, rounds in zip(by_H, ("200", "20"), strict=True):
        assert [_settings(r, *named) for r in arm.inner_grid(ctx).grid_runs(ctx)] == [
            (mod.TUNE_SEED, "1", lr, "100", "tune", rounds) for lr in ("0.0005", "0.001", "0.002")
        ]
        assert arm.inner(ctx) is None and arm.runs(ctx) == []
        assert {r.name for r, _ in part_dp} <= {r.name for r in arm.grid_runs(ctx)}  # waits on part dp's
    h50, h500 = by_H
    inner = [(h50.inner_grid(ctx).tune(lr), v) for lr, v in {5e-4: 1.8, 1e-3: 1.7, 2e-3: 1.75}.items()]
    inner += [
        (h500.inner_grid(ctx).tune(lr), v) for lr, v in {5e-4: 1.9, 1e-3: 1.8, 2e-3: 1.7, 4e-3: 1.72}.items()
    ]
    ctx = _write(tmp_path, mod, single, part_dp, inner)
    plan, report = mod.part_H500(ctx)
    h50, h500 = plan.tuned[1:]
    assert (h50.picked(ctx), h500.picked(ctx)) == ((1e-3, 100), (2e-3, 100))
    assert h500.inner_grid(ctx).grid(ctx) == (5e-4, 1e-3, 2e-3, 4e-3)
    for arm, ilr, rounds in zip((h50, h500), ("0.001", "0.002"), ("200", "20"), strict=True):
        assert [_settings(r, *named) for r in arm.inner(ctx).grid_runs(ctx)] == [
            (mod.TUNE_SEED, lr, ilr, "100", "tune", rounds) for lr in ("0.71", "1", "1.4")
        ]
        assert arm.runs(ctx) == []  # until its outer grid has run
    got = report()["by_H"]
    assert (got["500"]["inner_lr"], got["500"]["warmup"]) == (2e-3, 100)
    assert got["500"]["tuning"]["inner_grid"] == {"0.0005": 1.9, "0.001": 1.8, "0.002": 1.7, "0.004": 1.72}
    assert got["500"]["lr_grid_tuning"] == {"0.71": None, "1": 1.7, "1.4": None}  # 1: the inner grid's run
    more = [(h500.inner(ctx).tune(lr), v) for lr, v in {0.71: 1.75, 1.4: 1.72}.items()]
    ctx = _write(tmp_path, mod, single, part_dp, inner, more)
    plan, _ = mod.part_H500(ctx)
    assert [_settings(r, *named) for r in plan.tuned[2].runs(ctx)] == [
        (s, "1", "0.002", "100", None, "20") for s in (0, 1, 2)
    ]


@pytest.mark.timeout(120)
def test_pending_lists_the_runs_left_and_starts_none(tmp_path):
    """`--pending` prints what the parts would start now and estimates nothing without a ledger
    of timed runs; it starts no run and writes no JSON."""
    out = _run(tmp_path, "--part", "dp", "--ks", "4", "--starts", "warm", "--pending")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    dp = got["parts"]["dp"]
    assert dp["runs_now"] == 1 + 2 * 4 * 2  # the tuning seed's pretraining, single's and dp's grids
    assert (
        dp["runs_after_grids"] > 0 and dp["runs_without_estimate"] == dp["runs_now"] + dp["runs_after_grids"]
    )
    assert got["run_time_h"] == 0 and not (tmp_path / "out.json").exists()
    assert not list((tmp_path / "runs").glob("*/"))  # no run folder


@pytest.mark.timeout(60)
def test_pending_counts_the_runs_at_single_pick_before_single_has_picked(tmp_path):
    """The serial reference (k × 1,000 steps) and the ablation one grid point below single's pick
    wait for single's grid, yet their length is known: `--pending` counts them (3 seeds each) at
    placeholder settings, beside single's own reported seeds, and none is left untold."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    plan, _ = mod.part_dp(ctx)
    got = mod.pending(ctx, {"dp": plan})
    assert got["parts"]["dp"]["runs_not_told_yet"] == 0
    names = got["runs"]
    assert sorted(n.split("-")[1] for n in names if n.startswith("single4000-")) == ["s0", "s1", "s2"]
    # single's reported seeds and the ablation's, each at its own placeholder lr (not its grid)
    assert sorted(n.split("-")[1] for n in names if n.startswith("single-s") and "-s100-" not in n) == [
        "s0",
        "s0",
        "s1",
        "s1",
        "s2",
        "s2",
    ]


@pytest.mark.timeout(60)
def test_pending_estimates_a_run_from_the_ledger_rate_of_its_kind(tmp_path):
    """Data parallel k = 4 ran 1,000 steps in 500 s: part H500's data parallel (10,000 steps) is
    estimated at 5,000 s a run; single (no timed run) is not estimated."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    _, dp, _ = mod.dp_arms(ctx, 4, True)
    timed = dp.options["warmup 30"].tune(5e-4)
    row = {"name": timed.name, "label": timed.label, "flags": list(timed.flags), "elapsed_s": 500.0}
    (tmp_path / "runs.jsonl").write_text(json.dumps({**row, "summary": {"val_loss": 2.0}}) + "\n")
    ctx = _ctx(mod, tmp_path)
    plan, _ = mod.part_H500(ctx)
    got = mod.pending(ctx, {"H500": plan})["parts"]["H500"]
    assert not [n for n in got["now"] if "10000 steps" in n]  # nothing of H500's own before the picks
    # dp around its pick and its seeds; part dp's DiLoCo grids (inner lr 4 at outer 0.7, outer lr
    # 0.7 and 1.0, one run shared); at each H DiLoCo's inner and outer grids (3 each, one run
    # shared) and seeds; the seeds' pretraining
    assert got["runs_after_grids"] == 3 + 3 + (4 + 2 - 1) + 2 * (3 + 3 - 1 + 3) + 3
    # data parallel's 7 grid runs left (1,000 steps) and 6 runs of 10,000 steps, at 0.5 s a step;
    # single's and DiLoCo's have no rate
    assert got["run_time_h"] == round((7 * 500 + 6 * 5000) / 3600, 1)
    assert got["runs_without_estimate"] == got["runs_now"] + got["runs_after_grids"] - 13
    assert got["runs_resumed"] == 0
    # a grid run stopped after 18 of its 20 rounds (its folder's checkpoint) counts the 2 left;
    # a failed run's folder, or one without a round-N checkpoint, counts whole
    left = next(r for r in dp.options["warmup 30"].grid_runs(ctx) if r.name != timed.name)
    assert mod._work(left.flags)[1] == 1000 and _flag(left, "--rounds") == "20"
    (tmp_path / left.name / "checkpoints" / "round-000018").mkdir(parents=True)
    (tmp_path / left.name / "checkpoints" / ".tmp-round-000010").mkdir()
    resumed = mod.pending(ctx, {"H500": plan})["parts"]["H500"]
    assert resumed["runs_resumed"] == 1 and resumed["runs_now"] == got["runs_now"]
    assert resumed["run_time_h"] == round((6.1 * 500 + 6 * 5000) / 3600, 1)
    (tmp_path / left.name / "failed.json").write_text("{}")
    assert ctx.done_share(left) == 0.0


@pytest.mark.timeout(120)
def test_part_H500_is_reported_only_once_a_run_of_its_own_steps_has_run(tmp_path):
    """Part H500's plan holds part dp's k = 4 grids (the picks it centres on), so with only part
    dp's runs in the ledger it has not run: no `_H500.json` (a micro lane used to write one of
    nulls). Its first own run (10,000 steps) makes it a part that has run."""
    mod = _module()
    ctx = _ctx(mod, tmp_path)
    _, dp, _ = mod.dp_arms(ctx, 4, True)
    losses = {30: (2.4, 2.2, 2.0, 2.1), 100: (2.3, 1.9, 1.5, 1.7)}  # pick 2e-3, warm-up 100: inside
    grid = [
        (dp.options[f"warmup {w}"].tune(lr), v)
        for w, vs in losses.items()
        for lr, v in zip(mod.INNER_LR_GRID, vs)
    ]
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    (ledger / "runs.jsonl").write_text(_rows(grid))
    assert all(mod._work(r.flags)[1] == 1000 for r, _ in grid)
    p = _run(tmp_path, "--report-only", "--part", "dp,H500")
    assert p.returncode == 0, p.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["H500"]["status"] == "not run" and out["dp"].get("status") != "not run"
    assert not (tmp_path / "out_H500.json").exists()
    (tmp_path / "runs.jsonl").write_text(_rows(grid))  # the ledger _ctx reads
    ctx = _ctx(mod, tmp_path)
    plan, _ = mod.part_H500(ctx)
    own = [r for r in plan.tuned[0].grid_runs(ctx) if plan.owns(r)]  # data parallel around 2e-3
    assert [mod._work(r.flags)[1] for r in own] == [10_000] * 3
    (ledger / "runs.jsonl").write_text(_rows([*grid, (own[0], 1.9)]))
    p = _run(tmp_path, "--report-only", "--part", "dp,H500")
    assert p.returncode == 0, p.stderr
    part = json.loads((tmp_path / "out_H500.json").read_text())
    assert part["wall_time"]["runs_finished"] == 1  # its own run, not part dp's
    (tmp_path / "out_H500.json").unlink()
    # another invocation, to the default JSON's name (which covers every part)
    p = _run(tmp_path, "--report-only", "--part", "dp", "--ks", "8", out="reproduce_diloco.json")
    assert p.returncode == 0, p.stderr
    kept = json.loads((tmp_path / "reproduce_diloco.json").read_text())
    assert kept["H500"]["wall_time"]["runs_finished"] == 1
    assert not (tmp_path / "reproduce_diloco_H500.json").exists()  # only an invocation naming H500 writes it


@pytest.mark.timeout(180)
def test_pending_after_an_earlier_invocation_counts_its_shared_runs_once(tmp_path):
    """Two invocations of a lane share part dp's k = 4 runs: the second's --pending, given the
    first's output, counts only what the first did not; a file that is not --pending's exits 2."""
    first = _run(tmp_path, "--part", "dp", "--ks", "4", "--starts", "warm", "--pending")
    assert first.returncode == 0, first.stderr
    (tmp_path / "p1.json").write_text(first.stdout)
    one = json.loads(first.stdout)
    alone = json.loads(_run(tmp_path, "--part", "dp", "--ks", "4,8", "--starts", "warm", "--pending").stdout)
    after = _run(
        tmp_path, "--part", "dp", "--ks", "4,8", "--starts", "warm", "--pending",
        "--pending-after", str(tmp_path / "p1.json"),
    )  # fmt: skip
    assert after.returncode == 0, after.stderr
    two = json.loads(after.stdout)
    assert set(one["runs"]) <= set(alone["runs"])  # k = 4's runs are k = 4,8's too
    assert set(two["runs"]) == set(alone["runs"]) - set(one["runs"]) and two["runs"]
    (tmp_path / "bad.json").write_text('{"parts": {}}')
    bad = _run(tmp_path, "--part", "dp", "--pending", "--pending-after", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "not the output of --pending" in bad.stderr
