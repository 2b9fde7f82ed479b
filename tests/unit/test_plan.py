"""diloco plan (run/plan.py): its predictions are the simulator's own clock, so for a run the
simulator can train, the plan's wall time and bytes must equal the trained run's exactly."""

from __future__ import annotations

import dataclasses
import json

import pytest

from diloco.cli.main import main
from diloco.config import AsyncConfig, DyluConfig, SimConfig
from diloco.run.plan import Shapes, plan
from diloco.run.train import train

SPEEDS = (0.58, 0.75, 1.51)
CLOCK = SimConfig(speeds=SPEEDS, speed_jitter=0.1, bandwidth_mbps=20.0, latency_ms=30.0, procs=1)

CASES = {
    "sync, jitter, a slow link": dict(num_workers=3, sim=CLOCK),
    "sync, drops": dict(num_workers=3, sim=CLOCK, drop_prob=0.3),
    "sync DyLU, deadlines": dict(num_workers=3, sim=CLOCK, dylu=DyluConfig(enabled=True, by="time")),
    "streaming, overlap, fp4": dict(
        num_workers=3, sim=CLOCK, fragments=2, overlap_steps=1, codec="fp4", inner_steps=6, eval_every=6
    ),
    "async DN + DyLU (the default)": dict(num_workers=3, method="async", sim=CLOCK),
    "async naive, fixed H, bf16 down": dict(
        num_workers=3,
        method="async",
        sim=CLOCK,
        download_codec="bf16",
        async_=AsyncConfig(rule="naive", grace_s=0.0),
        dylu=DyluConfig(enabled=False),
    ),
    "data parallel": dict(num_workers=3, method="dp", sim=CLOCK),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_is_the_trained_runs_clock_and_bytes(tiny, case):
    cfg = tiny(**CASES[case])
    summary = train(cfg, progress=False)
    predicted = plan(cfg, rounds_simulated=cfg.rounds, search=False, runtime="sim")
    assert predicted["wall_time_s"] == pytest.approx(summary["sim_time_s"], rel=1e-12)
    assert sum(predicted["bytes_per_worker"]["sent"]) == summary["bytes_sent"]
    assert sum(predicted["bytes_per_worker"]["received"]) == summary["bytes_received"]
    assert all(0 < u <= 1 for u in predicted["utilisation"]["per_worker"])


@pytest.mark.timeout(60)
def test_a_long_run_is_scaled_from_its_simulated_rounds(tiny):
    cfg = tiny(num_workers=2, sim=SimConfig(speeds=(1.0, 2.0), bandwidth_mbps=10.0, procs=1), rounds=40)
    full = plan(cfg, rounds_simulated=40, search=False)
    scaled = plan(cfg, rounds_simulated=10, search=False)
    assert scaled["rounds_simulated"] == 10 and full["rounds_simulated"] == 40
    # no jitter: every round takes the same time, so scaling is exact
    assert scaled["wall_time_s"] == pytest.approx(full["wall_time_s"], rel=1e-9)
    assert scaled["bytes_per_worker"] == full["bytes_per_worker"]


@pytest.mark.timeout(60)
def test_utilisation_and_the_bandwidth_for_95_percent_by_hand(tiny):
    """Two equal workers, sync: a round is pull + H steps + push. With H·s of compute and 2
    messages of B bytes over L Mbit/s, utilisation = H·s / (H·s + 2·8B/L); 95% of the unlimited
    link's (1.0) needs L = 2·8B / (H·s·(1/0.95 − 1))."""
    cfg = tiny(
        num_workers=2,
        inner_steps=10,
        eval_every=10,
        sim=SimConfig(speeds=(0.5, 0.5), bandwidth_mbps=1.0, procs=1),
    )
    shapes = Shapes()
    nbytes = shapes.param_bytes(cfg)
    p = plan(cfg, shapes=shapes)
    compute = 10 * 0.5
    comm = 2 * nbytes * 8 / 1e6
    assert p["utilisation"]["mean"] == pytest.approx(compute / (compute + comm), rel=1e-12)
    need = 2 * nbytes * 8 / (compute * (1 / 0.95 - 1)) / 1e6
    assert all(b == pytest.approx(need, rel=0.011) and b >= need for b in p["bandwidth_for_95pct_mbps"])


@pytest.mark.timeout(60)
def test_async_reports_staleness_and_its_speedup_over_sync(tiny):
    cfg = tiny(num_workers=3, method="async", rounds=6, sim=SimConfig(speeds=SPEEDS, procs=1))
    p = plan(cfg, search=False)
    sync = plan(
        dataclasses.replace(cfg, method="diloco", async_=AsyncConfig(), dylu=DyluConfig()), search=False
    )
    assert p["speedup_vs_sync"] == pytest.approx(sync["wall_time_s"] / p["wall_time_s"], rel=1e-12)
    assert p["speedup_vs_sync"] > 1.5 and p["mean_staleness"] >= 0
    # as a server's summary counts it: each worker's compute ÷ its own time training (its first
    # job's compute, then first push to last), and Σ compute ÷ Σ training for the run
    per, train = p["utilisation"]["per_worker"], p["train_s"]
    assert all(0 < t <= p["wall_time_s"] for t in train) and all(0 < u <= 1 for u in per)
    assert p["utilisation"]["mean"] == pytest.approx(sum(u * t for u, t in zip(per, train)) / sum(train))


@pytest.mark.timeout(60)
def test_a_10b_model_is_sized_on_the_meta_device():
    """Nothing of a 10B model is allocated: its messages are sized from its shapes."""
    from diloco.cli.configure import with_flags

    cfg = with_flags(
        {}, {"model.name": "10b", "num_workers": 4, "sim.speeds": (0.8,) * 4, "codec": "fp4"}, "t"
    )
    shapes = Shapes()
    n = shapes.param_bytes(cfg) // 4
    assert 9.9e9 < n < 10e9
    p = plan(cfg, shapes=shapes, search=False)
    assert p["bytes_per_worker"]["received"][0] == cfg.rounds * 4 * n  # fp32 downloads
    assert p["bytes_per_worker"]["sent"][0] == cfg.rounds * (-(-n // 2) + 4 * (n // 256))  # ~0.52 B each


@pytest.mark.timeout(60)
def test_the_command_prints_json_and_sweeps(capsys):
    args = [
        "plan",
        "--workers",
        "2",
        "--inner-steps",
        "10",
        "--rounds",
        "4",
        "--step-s",
        "0.5",
        "--link-mbps",
        "50",
    ]
    assert main([*args, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert {
        "wall_time_s",
        "round_time_s",
        "utilisation",
        "bytes_per_worker",
        "bandwidth_for_95pct_mbps",
    } <= set(one)
    assert main([*args, "--json", "--sweep", "H=5,20", "--sweep", "codec=fp32,fp4"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["swept"] for r in rows] == [
        {"H": 5, "codec": "fp32"},
        {"H": 5, "codec": "fp4"},
        {"H": 20, "codec": "fp32"},
        {"H": 20, "codec": "fp4"},
    ]
    assert (
        rows[0]["wall_time_s"] < rows[2]["wall_time_s"]
        and rows[1]["bytes_per_worker"]["sent"][0] < rows[0]["bytes_per_worker"]["sent"][0]
    )
    assert main(args) == 0
    assert "wall time" in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra,says",
    [
        ([], "--step-s"),
        (["--step-s", "0"], "--step-s wants positive numbers"),
        (["--step-s", "-1"], "--step-s wants positive numbers"),
        (["--step-s", "1,2,3"], "3 values for 2 workers"),
        (["--step-s", "1", "--link-mbps", "1,2,3"], "3 values for 2 workers"),
        (["--step-s", "1", "--model", "7b"], "unknown model '7b'"),
        (["--step-s", "1", "--sweep", "codec=fp32,fp9"], "codec"),
        (["--step-s", "1", "--sweep", "colour=red"], "no setting"),
        (["--step-s", "1", "--method", "async", "--sweep", "fragments=1,2"], "fragments"),
        (["--step-s", "1", "--probe"], "not both"),
        (["--step-s", "1", "--speeds", "1,2"], "not both"),
        (["--step-s", "1", "--heterogeneity", "very"], "not both"),
        (["--step-s", "1", "--link-mbps", "10", "--bandwidth-mbps", "5"], "not both"),
        (["--step-s", "1", "--link-mbps", "10", "--sweep", "bandwidth-mbps=1,2"], "not both"),
        (["--step-s", "1", "--sweep", "runtime=sim,collective"], "cannot vary runtime"),
        (["--step-s", "1", "--sweep", "speeds=1"], "cannot vary speeds"),
        (["--step-s", "1", "--rounds-simulated", "0"], "at least 1"),
        (["--step-s", "1", "--link-mbps", "-3"], "--link-mbps wants Mbit/s"),
        (["--step-s", "1", "--method", "async", "--sweep", "dylu=ture,on"], "'ture' is not a value"),
        (["--step-s", "1", "--sweep", "H=50", "--sweep", "H=100"], "varies H twice"),
        (["--probe-link", "localhost"], "is not HOST:PORT"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(capsys, extra, says):
    with pytest.raises(SystemExit) as e:
        code = main(["plan", "--workers", "2", *extra])
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco: error:") and says in err and err.count("\n") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "table,alone,extra,says",
    [
        ("speeds = [1.0, 2.0]", [], ["--step-s", "1"], "give --step-s or {toml}'s [sim] speeds, not both"),
        ('heterogeneity = "mild"', None, ["--probe"], "give --probe or {toml}'s [sim] heterogeneity"),
        (
            "bandwidth_mbps = 5.0",
            ["--step-s", "1"],
            ["--step-s", "1", "--link-mbps", "10"],
            "give --link-mbps or {toml}'s [sim] bandwidth_mbps, not both",
        ),
    ],
)
def test_a_config_files_setting_overridden_by_a_plan_flag_is_refused(
    tmp_path, capsys, table, alone, extra, says
):
    """The config file's speeds, heterogeneity or bandwidth would be dropped without a word by
    --step-s, --probe or --link-mbps: refused like the same pair given as flags (docs/planning.md)."""
    toml = tmp_path / "run.toml"
    toml.write_text(f"[sim]\n{table}\n")
    head = ["plan", "--workers", "2", "--config", str(toml)]
    if alone is not None:  # without the overriding flag the file's value plans
        assert main([*head, *alone, "--json"]) == 0
        capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*head, *extra]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says.format(toml=toml) in err and err.count("\n") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["fp32", "fp4"])
def test_under_torchrun_the_exchange_is_a_ring_by_hand(tiny, codec):
    """--runtime collective: nothing is pulled; after every worker's H steps the outer_grads are
    all-reduced (fp32: 2(k − 1)/k × their float32 bytes, 2(k − 1) latencies) or their fp4
    messages all-gathered ((k − 1) × the message, k − 1 latencies), over the slowest link."""
    k, H, s, mbps, ms = 4, 10, 0.5, 100.0, 20.0
    cfg = tiny(
        num_workers=k,
        inner_steps=H,
        eval_every=H,
        codec=codec,
        sim=SimConfig(speeds=(s,) * k, bandwidth_mbps=mbps, latency_ms=ms, procs=1),
    )
    shapes = Shapes()
    p = plan(cfg, shapes=shapes, runtime="collective")
    from diloco.core.codec import build_codec
    from diloco.run.plan import simulate

    params = shapes._model(cfg)[1]
    if codec == "fp32":
        crossing, hops = 2 * (k - 1) / k * shapes.param_bytes(cfg), 2 * (k - 1)
    else:
        crossing, hops = (k - 1) * build_codec("fp4").message_bytes(params), k - 1
    round_s = H * s + crossing * 8 / (mbps * 1e6) + hops * ms / 1e3
    assert p["round_time_s"] == pytest.approx(round_s, rel=1e-12)
    assert p["runtime"] == "collective"
    # 95% of the unlimited link's utilisation H·s / (H·s + L): crossing·8/B ≤ (H·s + L)(1/0.95 − 1)
    need = crossing * 8 / ((H * s + hops * ms / 1e3) * (1 / 0.95 - 1)) / 1e6
    assert all(need <= b <= need * 1.011 for b in p["bandwidth_for_95pct_mbps"])
    star = simulate(cfg, shapes)  # a server's workers pull θ (fp32), then push, one after the other
    pull = shapes.param_bytes(cfg) * 8 / (mbps * 1e6) + ms / 1e3
    push = build_codec(codec).message_bytes(params) * 8 / (mbps * 1e6) + ms / 1e3
    assert star["wall_s"] == pytest.approx(cfg.rounds * (pull + H * s + push), rel=1e-12)


@pytest.mark.timeout(60)
def test_async_under_torchrun_is_refused(capsys):
    assert (
        main(["plan", "--workers", "2", "--step-s", "1", "--method", "async", "--runtime", "collective"]) == 2
    )
    assert "parameter server" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_the_docs_planning_tables_are_the_ones_the_json_gives():
    """docs/planning.md's tables for 1B and 10B are benchmarks/plan_tables.py's rendering of its
    saved results (so a number there is the JSON's)."""
    import importlib.util
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("plan_tables", root / "benchmarks" / "plan_tables.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cells = json.loads((root / "benchmarks" / "results" / "plan_tables.json").read_text())["cells"]
    assert len(cells) == len(bench.MODELS) * 3 * len(bench.WORKERS) * len(bench.LINKS)
    doc = (root / "docs" / "planning.md").read_text()
    block = re.search(re.escape(bench.BEGIN) + r"\n(.*?)\n" + re.escape(bench.END), doc, re.S)
    assert block is not None and block.group(1) == bench.markdown(cells)


@pytest.mark.timeout(60)
def test_per_worker_links_and_an_unlimited_one_by_hand(tiny):
    """Worker 1's link is 10 Mbit/s, worker 0's unlimited (0): a sync round waits for worker 1's
    pull and push; utilisation is per worker, and the link matters to nobody for one worker."""
    cfg = tiny(num_workers=2, inner_steps=10, eval_every=10, sim=SimConfig(speeds=(0.5, 0.5), procs=1))
    shapes = Shapes()
    p = plan(cfg, shapes=shapes, links=[0.0, 10.0], search=False)
    nbytes = shapes.param_bytes(cfg)
    round_s = 10 * 0.5 + 2 * nbytes * 8 / 10e6  # its fp32 pull and push over 10 Mbit/s
    assert p["round_time_s"] == pytest.approx(round_s, rel=1e-12)
    assert p["utilisation"]["per_worker"][0] == pytest.approx(5.0 / round_s, rel=1e-12)
    single = plan(tiny(method="single", num_workers=1, sim=SimConfig(speeds=(0.5,), procs=1)), shapes=shapes)
    assert single["bandwidth_for_95pct_mbps"] == [None]  # no message crosses a link


@pytest.mark.timeout(60)
def test_link_zero_is_unlimited_on_the_command_line(capsys):
    args = ["plan", "--workers", "2", "--inner-steps", "10", "--rounds", "2", "--step-s", "0.5", "--json"]
    assert main([*args, "--link-mbps", "0"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert free["round_time_s"] == pytest.approx(5.0) and free["utilisation"]["mean"] == pytest.approx(1.0)


@pytest.mark.timeout(60)
def test_a_hugging_face_model_config_is_sized_as_the_model_built_for_real(tmp_path, capsys):
    """--model-config: the planner builds the model on the meta device; its messages are the
    sizes of the same model built for real (tied weights counted once)."""
    from conftest import user_files

    from diloco.cli.configure import with_flags
    from diloco.model.init import build_model

    _, config = user_files(tmp_path)
    args = ["plan", "--model-config", config, "--workers", "2", "--rounds", "3", "--step-s", "0.5"]
    assert main([*args, "--link-mbps", "100", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    cfg = with_flags({}, {"model.hf_config": config, "num_workers": 2, "rounds": 3}, "t")
    n = sum(t.numel() for t in build_model(cfg).parameters() if t.requires_grad)
    assert n > 10_000 and p["bytes_per_worker"]["sent"] == [3 * 4 * n] * 2  # fp32: one outer_grad a round
    assert p["bytes_per_worker"]["received"] == [3 * 4 * n] * 2


@pytest.mark.timeout(60)
def test_a_servers_async_run_starts_with_each_workers_probe_alone(tiny):
    """Two workers of 1 s a step, H = 10, a budget of 40 steps, no link cost. As the server runs
    it (the default): probes of 1 step (to 1 s), deadline jobs of 10 (to 11 s), then 18 steps
    left: worker 0 a deadline of 10 with no headroom (10 kept for worker 1's next), worker 1 the
    8 left (to 19 s; worker 0 to 21 s): 3 jobs each. The simulator folds each probe into a first
    job of 10 (to 10 s), then 10 more (to 20 s): 2 jobs each."""
    cfg = tiny(
        method="async",
        num_workers=2,
        inner_steps=10,
        rounds=2,
        eval_every=0,
        sim=SimConfig(speeds=(1.0, 1.0), procs=1),
    )
    shapes = Shapes()
    n = shapes.param_bytes(cfg)
    server, sim = (plan(cfg, search=False, runtime=r, shapes=shapes) for r in ("server", "sim"))
    assert (server["wall_time_s"], server["train_s"]) == (21.0, [21.0, 19.0])
    assert server["bytes_per_worker"]["sent"] == [3 * n] * 2
    assert (sim["wall_time_s"], sim["bytes_per_worker"]["sent"]) == (20.0, [2 * n] * 2)
