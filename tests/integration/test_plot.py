"""`diloco plot` draws several runs from their run directories."""

import dataclasses

import pytest

from diloco.cli.main import main
from diloco.cli.plots import curve, run_label
from diloco.config import SimConfig
from diloco.run.train import train


@pytest.mark.timeout(90)
def test_plot_draws_runs_on_each_axis_and_rejects_bad_input(tiny, tmp_path, capsys):
    sim = SimConfig(speeds=(1.0, 2.0), procs=1)
    a, b = tmp_path / "a", tmp_path / "b"
    train(tiny(sim=sim, out=str(a)), progress=False)
    train(tiny(method="async", sim=sim, out=str(b)), progress=False)
    for x in ("sim_time_s", "inner_steps", "local_steps", "outer_updates", "bytes_sent"):
        out = tmp_path / f"{x}.png"
        assert main(["plot", str(a), str(b), "--x", x, "--out", str(out)]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    per_worker, all_workers = curve(b, "inner_steps")[0], curve(b, "local_steps")[0]
    assert all_workers == [2 * v for v in per_worker] and per_worker[-1] == 12  # 2 workers, 3 × 4 steps
    with pytest.raises(SystemExit) as e:  # argparse's own refusal of a value it does not list
        main(["plot", str(a), "--x", "nope", "--out", str(tmp_path / "x.png")])
    assert e.value.code == 2
    assert main(["plot", str(a), str(b), "--labels", "one", "--out", str(tmp_path / "x.png")]) == 2
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "one per run" in err and "has no metrics.jsonl" in err
    assert not (tmp_path / "x.png").exists()


def test_labels_come_from_configs():
    assert (
        run_label(
            {"method": "async", "num_workers": 4, "inner_steps": 50, "server": {"rule": "dn", "dylu": True}}
        )
        == "async dn+DyLU k=4 H=50"
    )
    assert run_label({"method": "single", "inner_steps": 50}) == "single H=50"


def test_labels_name_the_settings_that_differ_between_the_plotted_runs():
    from diloco.cli.plots import run_labels
    from diloco.config import AsyncConfig, TrainConfig

    base = TrainConfig(num_workers=2, inner_steps=5)
    runs = [
        base,
        dataclasses.replace(base, codec="int8"),
        dataclasses.replace(base, codec="fp4", out="runs/other", threads=2),  # where and how fast: not shown
        dataclasses.replace(base, fragments=2),
    ]
    assert run_labels([c.to_dict() for c in runs]) == [
        "diloco k=2 H=5 codec=fp32 fragments=1",
        "diloco k=2 H=5 codec=int8 fragments=1",
        "diloco k=2 H=5 codec=fp4 fragments=1",
        "diloco k=2 H=5 codec=fp32 fragments=2",
    ]
    slow = dataclasses.replace(base, method="async", async_=AsyncConfig())
    uneven = dataclasses.replace(slow, sim=dataclasses.replace(slow.sim, heterogeneity="very"))
    assert run_labels([slow.to_dict(), uneven.to_dict()]) == [
        "async dn+DyLU k=2 H=5 heterogeneity=none",
        "async dn+DyLU k=2 H=5 heterogeneity=very",
    ]
    assert run_labels([base.to_dict(), base.to_dict()]) == ["diloco k=2 H=5 #1", "diloco k=2 H=5 #2"]
    assert run_labels([base.to_dict()]) == ["diloco k=2 H=5"]
