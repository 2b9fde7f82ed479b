"""benchmarks/results/reproduce_diloco.json is what `reproduce_diloco.py --report-only` makes from
the ledger kept in git. The docs' tables and numbers are checked against the JSON
(test_docs_numbers.py); this closes the chain ledger → JSON → docs: a JSON left behind after the
lane's rows were merged into the ledger, or edited by hand, fails here."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import benchmark_module

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
REBUILD = "python benchmarks/reproduce_diloco.py --report-only && python benchmarks/doc_tables.py"


ABSENT = "<absent>"  # a key one side lacks: not the same as a null


def _differences(kept, made, path: str = "") -> list[str]:
    if isinstance(kept, dict) and isinstance(made, dict):
        return [
            d
            for k in sorted({*kept, *made})
            for d in _differences(kept.get(k, ABSENT), made.get(k, ABSENT), f"{path}.{k}")
        ]
    return [] if kept == made else [f"{path}: {json.dumps(kept)[:80]} in git, {json.dumps(made)[:80]} made"]


# each JSON in git the ledgers make, with the arguments of its invocation (docs/reproduction.md,
# "Issue 36's lane": the lane's k = 8 files hold part dp alone)
INVOCATIONS = {
    "reproduce_diloco.json": ("reproduce_ledger", ""),
    "reproduce_diloco_k8.json": ("reproduce_ledger", "--part dp --ks 8 --starts warm,scratch --dp-hs 10,50"),
    "reproduce_diloco_micro_k8.json": (
        "reproduce_micro_ledger",
        "--model micro --part dp --ks 8 --starts warm --dp-hs 10,50 --steps 1000",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(INVOCATIONS))
def test_the_reproduce_json_in_git_is_what_the_ledger_in_git_gives(tmp_path, monkeypatch, name):
    rd = benchmark_module("reproduce_diloco")
    ledger_name, args = INVOCATIONS[name]
    ledger = tmp_path / "ledger"
    shutil.copytree(RESULTS / ledger_name, ledger)  # --report-only saves the ledger it reads
    (tmp_path / "figures").mkdir()
    monkeypatch.setattr(rd, "FIGURES", tmp_path / "figures")  # the docs' figures stay as they are
    out = tmp_path / name
    argv = ["--report-only", *args.split(), "--workdir", str(tmp_path / "work"), "--ledger", str(ledger)]
    argv += ["--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["reproduce_diloco.py", *argv])
    rd.main()
    kept = json.loads((RESULTS / name).read_text())
    made = json.loads(out.read_text())
    # where the runs' folders and figures were: this test's own folders, not the default ones
    assert [Path(f).name for f in made.pop("figures")] == [Path(f).name for f in kept.pop("figures")]
    made.pop("workdir"), kept.pop("workdir")
    diff = _differences(kept, made)
    # part H500's own file, once a run of its own steps is in the ledger
    rebuild = f"python benchmarks/reproduce_diloco.py --report-only {args} --out benchmarks/results/{name}"
    rebuild = rebuild if args else REBUILD
    own, own_kept = out.with_name("reproduce_diloco_H500.json"), RESULTS / "reproduce_diloco_H500.json"
    if args:  # only the invocation that names part H500 writes its file
        assert not out.with_name(out.stem + "_H500.json").exists()
    else:
        assert own.exists() == own_kept.exists(), f"reproduce_diloco_H500.json: rebuild it ({REBUILD})"
    if own.exists():
        diff += _differences(json.loads(own_kept.read_text()), json.loads(own.read_text()), "H500 file")
    assert not diff, f"{name} is not what the ledger gives; rebuild it ({rebuild}):\n" + "\n".join(diff[:20])


@pytest.mark.timeout(10)
def test_each_arm_gain_over_single_is_taken_from_the_means_by_hand():
    """k = 8, warm: single 1.75067, data parallel 1.41737, DiLoCo 1.62666 (the means): data
    parallel gains (1.75067 − 1.41737) / 1.75067 = 0.190384, DiLoCo 0.124 / 1.75067 = 0.070836,
    0.124 / 0.3333 = 0.3721 of data parallel's gain."""
    row = json.loads((RESULTS / "reproduce_diloco.json").read_text())["dp"]["per_k"]["8"]
    means = [row[f"{arm}_warm_final_val_loss"] for arm in ("single", "dp", "diloco")]
    assert means == [1.75067, 1.41737, 1.62666]
    assert row["dp_warm_vs_single_gain"] == 0.190384
    assert row["diloco_warm_vs_single_gain"] == 0.070836
    assert row["diloco_warm_share_of_dp_gain"] == 0.3721


@pytest.mark.timeout(10)
def test_gains_are_none_where_an_arm_is_missing_and_a_share_only_where_data_parallel_gains():
    rd = benchmark_module("reproduce_diloco")

    def e(loss):
        return {"val_loss": {"mean": loss}} if loss is not None else {"val_loss": None}

    # (data parallel's gain, DiLoCo's gain, DiLoCo's share of data parallel's), by hand:
    assert rd.gains(e(2.0), e(1.5), e(1.75)) == (0.25, 0.125, 0.5)  # 0.5 / 2, 0.25 / 2, 0.25 / 0.5
    assert rd.gains(e(2.0), e(2.1), e(1.9)) == (-0.05, 0.05, None)  # data parallel worse: no share
    assert rd.gains(e(2.0), e(None), e(1.9)) == (None, 0.05, None)  # data parallel not run yet
    assert rd.gains(None, e(1.5), e(1.7)) == (None, None, None)  # single not run yet


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("argv", "suffix"),
    [
        ([], ""),  # the default JSON
        (["--out", "x/reproduce_diloco.json"], ""),  # the lane's copy of it
        (["--out", "x/reproduce_diloco_k8.json"], "_k8"),
        (["--model", "micro", "--out", "x/reproduce_diloco_micro_k8.json"], "_micro_k8"),
        (["--model", "micro"], "_micro"),
        (["--out", "x/mine.json"], "_mine"),
        (["--out", "x/reproduce_diloco2.json"], "_reproduce_diloco2"),  # not the default's name plus _…
        (["--quick"], ""),
        (["--part", "H", "--h-k", "8"], "_k8"),  # part H at another k: its own default name
    ],
)
def test_an_out_of_another_name_names_its_figures_after_it(argv, suffix):
    """The lane's k = 8 invocations write reproduce_diloco_k8.json: their figures must not
    overwrite the default JSON's (the docs' reproduce_dp.png)."""
    args = benchmark_module("reproduce_diloco").parse_args(argv)
    assert args.fig_suffix == suffix
    assert bool(args.out_suffix) == (
        "--out" in argv and Path(argv[argv.index("--out") + 1]).stem != "reproduce_diloco"
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv", [["--out", "x/reproduce_diloco_micro.json"], ["--out", "reproduce_diloco_micro_k8.json"]]
)
def test_an_out_named_as_another_model_s_json_is_refused(argv, capsys):
    """A nano run to the micro model's name would draw over the micro model's figures."""
    with pytest.raises(SystemExit) as e:
        benchmark_module("reproduce_diloco").parse_args(argv)
    assert e.value.code == 2
    assert "is another model's; give that --model or rename it" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_an_out_of_another_name_draws_only_the_parts_it_names(tmp_path, monkeypatch):
    rd = benchmark_module("reproduce_diloco")
    ledger = tmp_path / "ledger"
    shutil.copytree(RESULTS / "reproduce_ledger", ledger)
    monkeypatch.setattr(rd, "FIGURES", tmp_path / "figures")
    out = tmp_path / "reproduce_diloco_k8.json"
    argv = ["--report-only", "--part", "outer", "--workdir", str(tmp_path / "work"), "--ledger", str(ledger)]
    monkeypatch.setattr(sys, "argv", ["reproduce_diloco.py", *argv, "--out", str(out)])
    rd.main()
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["reproduce_outer_k8.png"]
    made = json.loads(out.read_text())
    assert [Path(f).name for f in made["figures"]] == ["reproduce_outer_k8.png"]
    assert set(rd.PARTS) & set(made) == {"outer"}  # the JSON too: the other parts are the default's
