"""benchmarks/doc_tables.py's tables for issue 36's JSON, rendered from a real one: the fixture is
`reproduce_diloco.py --quick --seeds 2 --part dp,drop,H500` (a tiny model; its dp and H500 parts,
tests/fixtures/reproduce_quick_issue36.json), so the tables are ready when the lane's JSON lands."""

import json
from pathlib import Path

import pytest
from conftest import benchmark_module

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "tests" / "fixtures" / "reproduce_quick_issue36.json").read_text())


def _tables():
    return benchmark_module("doc_tables")


@pytest.mark.timeout(30)
def test_the_tuning_table_has_every_arm_its_grid_and_its_pick_in_bold():
    text = _tables().tuning(DATA)
    arms, ablations = DATA["dp"]["tuning"]["arms"], DATA["dp"]["tuning"]["ablations"]
    rows = text.splitlines()[2:]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert names == list(arms) + [f"ablation: {a}" for a in ablations]  # the earlier rules' runs last
    rows = rows[: len(arms)]
    for row, r in zip(rows, arms.values(), strict=True):
        if "grids" in r:  # data parallel, single: one pick, in bold
            assert row.count("**") == 2 and f"**{r['lr']:g}: " in row, row
        else:  # DiLoCo: its inner lr's pick and its outer lr's, each in bold in its own grid
            assert row.count("**") == 4 and f"**{r['inner_lr']:g}: " in row and f"**{r['pick']:g}: " in row, (
                row
            )
    warm = rows[list(arms).index("dp k=4 warm")]
    assert warm.endswith("| inner lr 0.016, warm-up 30 |")  # inside its grid: 0.032 was worse
    assert "**0.016: 2.9691**" in warm  # warm-up 30's best, from the JSON's 2.96912988...
    diloco = rows[list(arms).index("diloco k=4 H=10 warm")]
    assert "| inner lr at outer lr 0.7, warm-up 30: 0.0005: 3.8714, " in diloco  # single's warm-up
    assert "**0.004: 3.2803**, 0.008: 3.3186; outer lr at inner lr 0.004: 0.3: 3.3870" in diloco
    assert diloco.endswith("| inner lr 0.004, outer lr 0.7 |")


@pytest.mark.timeout(30)
def test_a_diloco_arm_still_tuning_says_which_grid_it_waits_for():
    """Before its source's picks DiLoCo has no grid; after its inner grid, its outer one runs."""
    tables = _tables()
    assert tables._diloco_grids({"inner_grid": None, "warmup": None}) == (
        "not made yet: waits for the picks it starts from",
        "still tuning",
    )
    half = {"inner_grid": {"0.001": 1.9, "0.002": 1.8}, "inner_grid_at_outer_lr": 0.7, "inner_lr": 2e-3}
    grid, pick = tables._diloco_grids({**half, "warmup": 30, "grid": None})
    assert grid == "inner lr at outer lr 0.7, warm-up 30: 0.001: 1.9000, **0.002: 1.8000**"
    assert pick == "inner lr 0.002; outer lr still tuning"


@pytest.mark.timeout(30)
def test_the_tuning_table_lists_an_earlier_rule_runs_as_an_ablation_not_a_pick():
    data = json.loads(json.dumps(DATA))
    data["dp"]["tuning"]["ablations"] = {"diloco k=4 H=10 warm, inner lr 1e-3 wu 30": {"0.7": 3.61, "1": 3.5}}
    last = _tables().tuning(data).splitlines()[-1]
    assert (
        last == "| ablation: diloco k=4 H=10 warm, inner lr 1e-3 wu 30 | 0.7: 3.6100, 1: 3.5000 | not used |"
    )


@pytest.mark.timeout(30)
def test_the_h500_table_has_data_parallel_and_each_H_with_its_grids_gap_and_bytes():
    part = DATA["H500"]
    lines = _tables().h500(part).splitlines()
    assert len(lines) == 2 + 1 + len(part["by_H"])
    assert lines[2].startswith(
        "| data parallel | 80 | inner lr 0.016, warm-up 30 (inner lr at warm-up 30: 0.008: 2.8832, "
        "**0.016: 2.7475**, 0.032: 3.1617) | 3.0535 (2.9684–3.1387)"
    )
    h10 = lines[3]
    assert h10.startswith(
        "| DiLoCo H = 10 | 8 | inner lr 0.004, outer lr 0.7 (inner lr at outer lr 0.7, warm-up 30: "
        "0.002: 3.1105, **0.004: 3.0119**, 0.008: 3.0187; outer lr at inner lr 0.004: 0.5: 3.0244, "
        "**0.7: 3.0119**, 0.98: 3.0788) | 3.1420 (3.0978–3.1862) |"
    )
    assert "**+2.9%** (paired by seed −1.3% … +7.3%) | 63% |" in h10 and h10.endswith("= 10.0× |")
    assert (
        lines[4].startswith("| DiLoCo H = 20 | 4 | inner lr 0.004, outer lr 0.5 (")
        and "= 20.0× |" in lines[4]
    )


def _dp_seed_0_only(dp: dict, diloco: dict) -> tuple[float, float]:
    """Leaves data parallel's entry with seed 0 only (the fixture has 2 seeds, both run) and
    DiLoCo's paired gap on it, as reproduce_diloco's versus() pairs them: (seed 0's loss, gap)."""
    assert len(dp["runs"]) == 2 and dp["val_loss"]["n"] == 2
    first = dp["per_seed"]["0"]
    dp["per_seed"] = {"0": first}
    dp["val_loss"] = {"mean": first, "min": first, "max": first, "n": 1}
    paired = diloco["per_seed"]["0"] / first - 1
    diloco["vs_dp_paired"] = {"mean": paired, "min": paired, "max": paired, "n": 1}
    return first, paired


@pytest.mark.timeout(30)
def test_the_h500_table_says_how_many_seeds_a_mean_has_while_some_have_not_run():
    """A lane half way through part H500's reported seeds (data parallel's seed 0 only): the mean
    is of the seeds that ran, and a gap only of the seeds both arms have, not of unequal means."""
    import copy

    tables, part = _tables(), copy.deepcopy(DATA["H500"])
    first, paired = _dp_seed_0_only(part["dp"], part["by_H"]["10"])
    lines = tables.h500(part).splitlines()
    assert lines[2].endswith(f"| {first:.4f} (seed 0; 1 of 2 seeds) | — | — | — |"), lines[2]
    assert f"| {tables._pct(paired, 2)} on seed 0 (paired; 1 of 2 seeds) |" in lines[3], lines[3]
    assert "of 2 seeds" not in tables.h500(DATA["H500"])  # every seed run: no count, the mean's gap


@pytest.mark.timeout(30)
@pytest.mark.parametrize("start", ["warm", "scratch"])
def test_the_dp_tables_show_each_start_with_every_arm_tuned_pick(start):
    """Part dp's table per start: its losses from the JSON, and a row of each k's picks."""
    text = getattr(_tables(), f"dp_{start}")(DATA)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()}
    k4 = DATA["dp"]["per_k"]["4"][start]
    dp = k4["dp"]["val_loss"]
    assert rows["data parallel (k× batch, 40 steps)"].split(" | ")[1].startswith(f"{dp['mean']:.4f}")
    picks = rows["picked on the tuning seed and split"].split(" | ")[1]
    assert f"data parallel: inner lr {k4['dp']['lr']:g}, warm-up {k4['dp']['pick'].split()[-1]}" in picks
    for k, cell in zip(("4", "8"), rows["picked on the tuning seed and split"].split(" | ")[1:], strict=True):
        di = DATA["dp"]["per_k"][k][start]["diloco"]
        want = f"DiLoCo: inner lr {di['inner_lr']:g}, warm-up {di['warmup']}, outer lr {di['outer_lr']:g}"
        assert cell.rstrip(" |").endswith(want), cell
    assert (start == "warm") == any(r.startswith("serial") for r in rows)
    match = rows["data parallel's steps to reach DiLoCo's final loss (evaluation curves)"].split(" | ")[1:]
    for k, cell in zip(("4", "8"), match, strict=True):
        share = DATA["dp"]["per_k"][k][start]["diloco"]["dp_steps_to_match"]
        assert cell.rstrip(" |") == f"{round(100 * share)}%", cell


@pytest.mark.timeout(30)
def test_the_dp_table_says_how_many_seeds_a_mean_has_while_some_have_not_run():
    """A lane half way through part dp's reported seeds (data parallel k = 4's seed 0 only): its
    cell counts the seeds, and DiLoCo's gap is only on the seeds both arms have."""
    import copy

    tables, data = _tables(), copy.deepcopy(DATA)
    row = data["dp"]["per_k"]["4"]["scratch"]
    first, paired = _dp_seed_0_only(row["dp"], row["diloco"])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in tables.dp_scratch(data).splitlines()}
    assert rows["data parallel (k× batch, 40 steps)"].split(" | ")[1] == f"{first:.4f} (seed 0; 1 of 2 seeds)"
    gap = rows["DiLoCo vs data parallel"].split(" | ")[1]
    assert gap == f"{tables._pct(paired, 2)} on seed 0 (paired; 1 of 2 seeds)", gap
    assert "of 2 seeds" not in tables.dp_scratch(DATA)  # every seed run: no count, the mean's gap


@pytest.mark.timeout(30)
def test_the_dp_table_has_the_ablations_below_the_picks_as_rows_where_run():
    """The ablations' rows follow DiLoCo's gap to data parallel: single's with its settings and
    loss (k = 8's cell the same runs), data parallel's per k with its own settings, each followed
    by DiLoCo's gap to it; a JSON without them (before the ablations) has no such rows."""
    import copy

    tables, data = _tables(), copy.deepcopy(DATA)
    rows = data["dp"]["per_k"]
    scratch = rows["4"]["scratch"]
    lower = copy.deepcopy(scratch["single"])  # its shape: an entry of seeds 0 and 1
    lower.update(lr=scratch["single"]["lr"] / 2, warmup=30)
    scratch["single_lr_below"] = lower
    for k in ("4", "8"):
        e = copy.deepcopy(rows[k]["scratch"]["dp"])
        e.update(lr=rows[k]["scratch"]["dp"]["lr"] / 2, warmup=100)
        rows[k]["scratch"]["dp_lr_below"] = e
    # k = 4's DiLoCo gaps to the ablations as reproduce_diloco's report makes them; k = 8's not yet
    di, below = rows["4"]["scratch"]["diloco"], rows["4"]["scratch"]["dp_lr_below"]
    benchmark_module("reproduce_diloco").versus(di, below, "vs_dp_lr_below")
    benchmark_module("reproduce_diloco").versus(di, lower, "vs_single_lr_below")
    m_di, m_below, m_lower = (sum(x["per_seed"].values()) / len(x["per_seed"]) for x in (di, below, lower))
    lines = tables.dp_scratch(data).splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("| DiLoCo vs data parallel |"))
    want = "| ablation: `single` one grid point below its pick "
    want += f"(inner lr {lower['lr']:g}, warm-up 30, 40 steps) "
    assert lines[i + 1] == want + f"| {tables._loss(lower['val_loss'])} | (same) |", lines[i + 1]
    cells = lines[i + 3].split(" | ")
    assert cells[0] == "| ablation: data parallel one grid point below its pick (40 steps)"
    for k, cell in zip(("4", "8"), cells[1:], strict=True):
        e = rows[k]["scratch"]["dp_lr_below"]
        assert cell.rstrip(" |") == f"inner lr {e['lr']:g}, warm-up 100: {tables._loss(e['val_loss'])}", cell
    for j, m in ((2, m_lower), (4, m_below)):  # DiLoCo against single's ablation, then dp's
        gap = lines[i + j].split(" | ")
        assert gap[0] == "| DiLoCo vs that ablation" and gap[2] == "not run |", gap
        assert gap[1].startswith(f"**{tables._pct(m_di / m - 1, 1)}** (paired by seed "), gap[1]
    lower.update(lr=None, warmup=None, val_loss=None, per_seed={})  # single still tuning
    assert "(still tuning, 40 steps) | not run | (same) |" in tables.dp_scratch(data)
    assert "ablation:" not in tables.dp_scratch(DATA) and "ablation:" not in tables.dp_warm(DATA)


@pytest.mark.timeout(30)
def test_the_steps_to_match_cell_says_never_where_diloco_ends_below_data_parallel():
    tables = _tables()
    assert tables._match({"dp_steps_to_match": 0.5884, "vs_dp": 0.11}) == "59%"
    never = "never: DiLoCo ends below data parallel's curve"
    assert (
        tables._match({"dp_steps_to_match": None, "dp_steps_to_match_why": never})
        == "never (DiLoCo ends below)"
    )
    # a run without a curve (a rebuilt ledger row) is not "never", whatever the gap says
    lost = {"dp_steps_to_match": None, "dp_steps_to_match_why": "no whole evaluation curve for every run"}
    assert tables._match({**lost, "vs_dp": -0.01}) == "—"
    assert tables._match({"dp_steps_to_match": None, "vs_dp": None}) == "—"  # not run yet


@pytest.mark.timeout(30)
def test_the_dp_table_of_a_lane_still_tuning_says_not_run_and_tuning():
    """The report runs with partial ledgers: arms without runs (DiLoCo waiting for single's
    pick, its entry without bytes) render as "not run" and "still tuning", not an error."""
    data = json.loads(json.dumps(DATA))
    for k in ("4", "8"):
        row = data["dp"]["per_k"][k]["warm"]
        row["diloco"], row["diloco_outer_lr"] = {"val_loss": None, "vs_dp": None}, None
        row["dp"] = {"val_loss": None, "grids": {}, "pick": None, "lr": None}
    data["dp"]["pretrain"] = {"val_loss": None}
    lines = _tables().dp_warm(data).splitlines()
    assert lines[0].startswith("| run (warm start from the 40-step") and "val_loss" not in lines[0]
    assert (
        "| **DiLoCo** (H = 10, Nesterov, best outer lr still tuning) | **not run** | **not run** |" in lines
    )
    assert "| bytes sent per worker, data parallel / DiLoCo | not run | not run |" in lines
    assert (
        lines[-1].count("DiLoCo: still tuning") == 2 and lines[-1].count("data parallel: still tuning") == 2
    )


@pytest.mark.timeout(30)
def test_the_drop_paper_table_counts_seeds_while_some_have_not_run_then_gives_the_paired_range():
    """Part drop's paper configuration, from the rows reproduce_diloco.json holds (their shape is
    the benchmark's; the gaps made by its `versus` and `versus_ppl`): seed 0 and 1 of p = 0.5
    against three seeds of no drops, then all three, then none."""
    import copy

    tables, rd = _tables(), benchmark_module("reproduce_diloco")
    real = json.loads((ROOT / "benchmarks" / "results" / "reproduce_diloco.json").read_text())
    data = copy.deepcopy(real)
    rows = data["drop"]["paper_configuration"]
    base, drop = rows["0"], rows["0.5"]
    assert (base["k"], base["warm"], base["after"], len(base["runs"]), len(drop["runs"])) == (
        8,
        True,
        "global",
        3,
        3,
    )

    def seeds(row, values):
        row["per_seed"] = {str(s): v for s, v in enumerate(values)}
        vs = row["per_seed"].values()
        row["val_loss"] = {"mean": sum(vs) / len(vs), "min": min(vs), "max": max(vs), "n": len(vs)}
        if row is drop:
            rd.versus_ppl(rd.versus(row, base), base)

    seeds(base, [1.70, 1.72, 1.74])
    # +0.01 and +0.0172 in loss: +0.59% and +1.0% relative, exp(0.01) − 1 = 1.005% and
    # exp(0.0172) − 1 = 1.735% in perplexity (means 0.79% and 1.37%)
    seeds(drop, [1.71, 1.7372])
    lines = tables.drop_paper(data).splitlines()
    assert lines[0].startswith("| the paper's configuration: k = 8, warm start, `--after-drop global` |")
    assert lines[2] == "| no drops | 1.7200 (1.7000–1.7400) | baseline | baseline |"
    assert lines[3] == (
        "| p = 0.5 | 1.7236 (1.7100–1.7372; 2 of 3 seeds) | +0.79% on seeds 0, 1 (paired; 2 of 3 seeds) "
        "| +1.37% on seeds 0, 1 (paired; 2 of 3 seeds) |"
    )
    seeds(drop, [1.71, 1.7372, 1.75])  # seed 2: +0.01 again, +0.575% relative
    assert tables.drop_paper(data).splitlines()[3] == (
        "| p = 0.5 | 1.7324 (1.7100–1.7500) | +0.72% (+0.58% … +1.00%) | +1.2% (+1.0% … +1.7%) |"
    )
    rows["0.5"] = copy.deepcopy(real["drop"]["paper_configuration"]["0.5"])
    rows["0.5"].update(per_seed={}, val_loss=None, vs_baseline_paired=None, vs_baseline_ppl_paired=None)
    assert tables.drop_paper(data).splitlines()[3] == "| p = 0.5 | not run | not run | not run |"


@pytest.mark.timeout(30)
def test_versus_ppl_is_the_perplexity_ratio_per_seed_by_hand():
    rd = benchmark_module("reproduce_diloco")
    base = {"per_seed": {"0": 2.0, "1": 2.1, "2": 1.9}}
    e = rd.versus_ppl({"per_seed": {"0": 2.02, "1": 2.1, "3": 5.0}}, base)  # seed 3 has no pair
    # exp(0.02) − 1 = 0.0202013, exp(0) − 1 = 0: mean 0.0101007
    assert e["vs_baseline_ppl_paired"] == {"mean": 0.0101, "min": 0.0, "max": 0.0202, "n": 2}
    assert rd.versus_ppl({"per_seed": {}}, base)["vs_baseline_ppl_paired"] is None


@pytest.mark.timeout(30)
def test_the_dp_by_H_table_has_data_parallel_then_each_H_for_every_k_and_start():
    """The fixture's part dp ran H = 10 and 20 (`--dp-hs`) at k = 4 and 8 from both starts."""
    d = DATA["dp"]
    lines = _tables().dp_by_H(DATA).splitlines()
    rows = [line.split(" | ") for line in lines[2:]]
    expected = [
        (k, s, who) for k in d["k"] for s in d["starts"] for who in ["data parallel", "H = 10", "H = 20"]
    ]
    assert [(int(r[2]), r[1], r[0].removeprefix("| ").removeprefix("DiLoCo ")) for r in rows] == expected
    # k = 4, warm: data parallel, then H = 10 (4 rounds of its 40 steps), as the JSON holds them
    dp, h10 = rows[3], rows[4]
    head = ["| data parallel", "warm", "4", "40", "inner lr 0.016, warm-up 30", "3.1925 (3.1610–3.2240)"]
    assert dp == [*head, "—", "—", "— |"]
    assert h10[3:] == [
        "4",
        "inner lr 0.004, warm-up 30, outer lr 0.7",
        "3.3858 (3.3612–3.4104)",
        "**+6.1%** (paired by seed +5.8% … +6.3%)",
        "49%",
        "5.6 MB / 0.6 MB = 10.0× |",
    ]


@pytest.mark.timeout(30)
def test_the_dp_by_H_table_of_a_file_not_run_says_how_many_runs_are_planned():
    assert _tables().dp_by_H({"model": "micro", "dp": {"status": "not run", "runs_planned": 17}}) == (
        "| micro: not run yet (17 runs planned) |\n| --- |\n"
    )


@pytest.mark.timeout(30)
def test_the_dp_table_has_diloco_s_stall_ablation_where_the_rule_gave_one():
    """A DiLoCo arm with a stalled seed gets the ablation below its pick (reproduce_diloco's
    IfStalled); its row names its settings per k, "—" where the rule gave none."""
    import copy

    tables, data = _tables(), copy.deepcopy(DATA)
    rows = data["dp"]["per_k"]
    assert "DiLoCo one grid point below" not in tables.dp_scratch(data)
    di = rows["8"]["scratch"]["diloco"]
    lower = copy.deepcopy(di)
    lower.update(lr=2e-3, warmup=30, outer_lr=0.7)
    di["lr_below"] = lower
    line = next(x for x in tables.dp_scratch(data).splitlines() if "DiLoCo one grid point below" in x)
    cells = line.split(" | ")
    assert cells[1] == "—", line
    assert (
        cells[2].rstrip(" |") == f"inner lr 0.002, warm-up 30, outer lr 0.7: {tables._loss_seeds(lower)}"
    ), line


@pytest.mark.timeout(30)
def test_the_by_h_table_has_a_row_for_a_diloco_stall_ablation_at_any_h():
    """The lane's k = 8 files report DiLoCo at H = 10 and 50: the stall rule's ablation of
    either gets a row of its own under its arm's, with its settings and its gap to data parallel."""
    import copy

    tables, data = _tables(), copy.deepcopy(DATA)
    row = data["dp"]["per_k"]["8"]["scratch"]
    assert "one grid point below its pick (a seed stalled)" not in tables.dp_by_H(data)
    H, e = next(iter(row["diloco_by_H"].items()))
    lower = copy.deepcopy(e)
    lower.update(lr=2e-3, warmup=30, outer_lr=0.7)
    e["lr_below"] = lower
    lines = tables.dp_by_H(data).splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith(f"| ablation: DiLoCo H = {H} "))
    assert lines[i - 1].startswith(f"| DiLoCo H = {H} | scratch | 8 |"), lines[i - 1]
    assert f"| inner lr 0.002, warm-up 30, outer lr 0.7 | {tables._loss_seeds(lower)} |" in lines[i], lines[i]
