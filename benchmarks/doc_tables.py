"""Tables of the docs made from the benchmarks' JSON, so they cannot drift from it (issue 36).

A table in a doc sits between two markers, the first naming its generator and its JSON:

    <!-- table: codec results/reproduce_diloco.json -->
    | ... the table ... |
    <!-- /table -->

`python benchmarks/doc_tables.py` rewrites every such table in docs/ from its JSON;
`--check` rewrites nothing and exits 1 when a table differs from what its JSON gives
(tests/unit/test_docs_numbers.py runs the check in the default suite).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKED = re.compile(r"<!-- table: (\w+) (results/[\w\-]+\.json) -->\n(.*?)<!-- /table -->\n", re.S)


TUNING = "still tuning"  # an arm whose grid has not picked yet (the lane is running)


def _round(x: float | Decimal, digits: int) -> Decimal:
    """`x` to `digits` decimals, halves rounded up, from its shortest repr (the JSON's 1.90425 is
    1.9043, as written by hand, not the 1.9042 its binary value would give)."""
    return Decimal(repr(x) if isinstance(x, float) else x).quantize(Decimal(1).scaleb(-digits), ROUND_HALF_UP)


def _loss(stats: dict | None) -> str:
    """A mean and its range over seeds: 2.0904 (2.0853–2.0952)."""
    if not stats or stats.get("mean") is None:
        return "not run"
    return f"{_round(stats['mean'], 4)} ({_round(stats['min'], 4)}–{_round(stats['max'], 4)})"


def _pct(x: float, digits: int = 2) -> str:
    """A signed percentage, − for minus: +0.33%, −0.54%."""
    v = _round(Decimal(repr(x)) * 100, digits)
    return ("−" if v < 0 or (v == 0 and str(x).startswith("-")) else "+") + f"{abs(v)}%"


def _paired(p: dict | None, bold: bool = False) -> str:
    """The mean paired difference and its range over seeds: **+0.33%** (−0.54% … +0.95%); in
    thousandths of a percent where every figure is below a hundredth."""
    if not p:
        return "not run"
    digits = 3 if max(abs(p[k]) for k in ("mean", "min", "max")) < 1e-4 else 2
    mean = _pct(p["mean"], digits)
    return f"{f'**{mean}**' if bold else mean} ({_pct(p['min'], digits)} … {_pct(p['max'], digits)})"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


CODEC_NAMES = {
    "fp32": "fp32",
    "int8": "int8",
    "int8_ef": "int8 + error feedback",
    "fp4": "fp4",
    "fp4_ef": "fp4 + error feedback",
    "topk50": "top-k 50%",
    "topk50_ef": "top-k 50% + error feedback",
}


BOLD = {"fp4", "fp4_ef", "topk50", "topk50_ef"}  # the rows whose cost the text discusses


def codec(data: dict, names: tuple[str, ...] = ("fp32", "int8", "int8_ef", "fp4", "fp4_ef")) -> str:
    """reproduce_diloco.py's part codec: bytes, final val_loss and the paired cost of each codec."""
    rows = data["codec"]["by_codec"]
    base = rows["fp32"]["bytes_sent_per_worker"]
    out = [
        "| outer_grads | bytes sent per worker | final val_loss | vs fp32, paired by seed |",
        "| --- | --- | --- | --- |",
    ]
    for name in names:
        e = rows[name]
        sent = e["bytes_sent_per_worker"]
        fewer = f" ({base / sent:.1f}× fewer)" if sent < base else ""
        vs = "baseline" if name == "fp32" else _paired(e.get("vs_baseline_paired"), bold=name in BOLD)
        out.append(f"| {CODEC_NAMES[name]} | {_mb(sent)}{fewer} | {_loss(e['val_loss'])} | {vs} |")
    return "\n".join(out) + "\n"


def pruning(data: dict) -> str:
    """The pruning arms of part codec against its fp32 runs."""
    return codec(data, ("fp32", "topk50", "topk50_ef"))


def _dp(data: dict, start: str) -> str:
    """reproduce_diloco.py's part dp from one start, k = 4 and 8 side by side; for a JSON with
    issue 36's `tuning`, also each arm's settings picked on the tuning seed and split."""
    d = data["dp"]
    ks = [str(k) for k in d["k"] if start in d["per_k"][str(k)]]
    rows = {k: d["per_k"][k][start] for k in ks}
    steps = f"{d['steps']:,}"

    def cells(get: Callable[[str, dict], str]) -> str:
        return " | ".join(get(k, rows[k]) for k in ks)

    lrs = sorted({_num(r["diloco_outer_lr"]) for r in rows.values() if r.get("diloco_outer_lr") is not None})
    model = "" if data.get("model", "nano") == "nano" else f" {data['model']}"
    if start == "warm":
        pre = (d["pretrain"].get("val_loss") or {}).get("mean")
        head = f"warm start from the {d['pretrain_steps']:,}-step{model} model"
        head += "" if pre is None else f", val_loss {_round(pre, 4)} mean"
    else:
        head = f"from scratch{',' if model else ''}{model}"
    out = [
        f"| run ({head}) | " + " | ".join(f"k = {k}" for k in ks) + " |",
        "| --- |" + " --- |" * len(ks),
        f"| `single` (1 worker, AdamW, {steps} steps) | "
        + cells(lambda k, r: _loss_seeds(r["single"]) if k == ks[0] else "(same)")
        + " |",
        f"| data parallel (k× batch, {steps} steps) | " + cells(lambda k, r: _loss_seeds(r["dp"])) + " |",
        f"| **DiLoCo** (H = {d['H']}, Nesterov, best outer lr {' / '.join(lrs) or TUNING}) | "
        + cells(lambda k, r: f"**{_loss_seeds(r['diloco'])}**")
        + " |",
        "| DiLoCo vs data parallel | " + cells(lambda k, r: _gap_to_dp(r["diloco"], r["dp"])) + " |",
        *_below(rows, ks, steps),
    ]
    # the serial reference (warm only): every k's cell in the old JSON, the ks it ran for in issue 36's
    if start == "warm" and ("tuning" not in d or any("serial" in r for r in rows.values())):
        out.append(
            f"| serial: 1 worker, k × {steps} steps (the same tokens) | "
            + cells(lambda k, r: _serial(r))
            + " |"
        )
    out.append(
        "| bytes sent per worker, data parallel / DiLoCo | "
        + cells(
            lambda k, r: _bytes_ratio(
                r["dp"].get("bytes_sent_per_worker"), r["diloco"].get("bytes_sent_per_worker")
            )
        )
        + " |"
    )
    if "tuning" in d:
        out.append(
            "| data parallel's steps to reach DiLoCo's final loss (evaluation curves) | "
            + cells(lambda k, r: _match(r["diloco"]))
            + " |"
        )
        out.append("| picked on the tuning seed and split | " + cells(lambda k, r: _picks(r)) + " |")
    return "\n".join(out) + "\n"


def _match(e: dict) -> str:
    """DiLoCo's run counted in data parallel's steps: the share of them after which data
    parallel's mean evaluation curve reaches DiLoCo's final evaluation."""
    share = e.get("dp_steps_to_match")
    if share is not None:
        return f"{share:.0%}"
    why = e.get("dp_steps_to_match_why") or ""
    return "never (DiLoCo ends below)" if why.startswith("never") else "—"


def _inner_pick(e: dict) -> str:
    """single's or data parallel's tuned inner lr and warm-up."""
    lr, pick = e.get("lr"), e.get("pick")
    return TUNING if lr is None else f"inner lr {lr:g}, warm-up {pick.split()[-1]}"


def _diloco_pick(di: dict) -> str:
    """DiLoCo's tuned inner lr, warm-up and outer lr."""
    if di.get("outer_lr") is None:
        return TUNING
    return f"inner lr {di['inner_lr']:g}, warm-up {di['warmup']}, outer lr {di['outer_lr']:g}"


def _picks(row: dict) -> str:
    """One k's tuned settings: single's and data parallel's inner lr and warm-up, DiLoCo's inner
    lr, warm-up and outer lr."""
    single, dp, diloco = _inner_pick(row["single"]), _inner_pick(row["dp"]), _diloco_pick(row["diloco"])
    return f"single: {single}; data parallel: {dp}; DiLoCo: {diloco}"


def dp_by_H(data: dict) -> str:
    """Part dp at each of its H values (`--dp-hs`; the lane's k = 8 files): data parallel, then
    DiLoCo at each H, from each start, each tuned on the tuning seed and split."""
    d = data["dp"]
    model = data.get("model", "nano")
    if d.get("status") == "not run":
        return f"| {model}: not run yet ({d['runs_planned']} runs planned) |\n| --- |\n"
    steps = d["steps"]
    out = [
        f"| run ({model}, {steps:,} steps per worker) | start | k | syncs "
        "| picked on the tuning seed and split | final val_loss | vs data parallel "
        "| data parallel's steps to reach it | bytes sent per worker, data parallel / this |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in d["k"]:
        for start in d["starts"]:
            row = d["per_k"][str(k)].get(start)
            if row is None:
                continue
            dp = row["dp"]
            picked, loss = _inner_pick(dp), _loss_seeds(dp)
            out.append(f"| data parallel | {start} | {k} | {steps:,} | {picked} | {loss} | — | — | — |")
            for H, e in row["diloco_by_H"].items():
                out.append(
                    f"| DiLoCo H = {H} | {start} | {k} | {steps // int(H):,} | {_diloco_pick(e)} | "
                    f"{_loss_seeds(e)} | {_gap_to_dp(e, dp)} | {_match(e)} | "
                    f"{_bytes_ratio(dp.get('bytes_sent_per_worker'), e.get('bytes_sent_per_worker'))} |"
                )
                if lower := e.get("lr_below"):  # the stall rule's ablation below DiLoCo's pick
                    out.append(
                        f"| ablation: DiLoCo H = {H} one grid point below its pick (a seed stalled) "
                        f"| {start} | {k} | {steps // int(H):,} | inner lr {_num(lower['lr'])}, warm-up "
                        f"{lower['warmup']}, outer lr {_num(lower['outer_lr'])} | {_loss_seeds(lower)} | "
                        f"{_gap_to_dp(lower, dp)} | — | — |"
                    )
    return "\n".join(out) + "\n"


def _below(rows: dict[str, dict], ks: list[str], steps: str) -> list[str]:
    """Part dp's ablations where the JSON has them: single, then data parallel (per k: its own
    lr), one inner-lr grid point below the pick, each followed by DiLoCo's gap to it."""

    def at(e: dict) -> str:
        return f"inner lr {_num(e['lr'])}, warm-up {e['warmup']}" if e.get("lr") else "still tuning"

    def versus(arm: str) -> str:
        key = f"vs_{arm}_lr_below"
        di = [rows[k]["diloco"] for k in ks]
        cells = (_paired_by_seed(e.get(key), e.get(f"{key}_paired")) for e in di)
        return "| DiLoCo vs that ablation | " + " | ".join(cells) + " |"

    out = []
    if (single := rows[ks[0]].get("single_lr_below")) is not None:
        out.append(
            f"| ablation: `single` one grid point below its pick ({at(single)}, {steps} steps) "
            f"| {_loss_seeds(single)} |" + " (same) |" * (len(ks) - 1)
        )
        out.append(versus("single"))
    if any("dp_lr_below" in r for r in rows.values()):
        cells = [r.get("dp_lr_below") for r in (rows[k] for k in ks)]
        out.append(
            f"| ablation: data parallel one grid point below its pick ({steps} steps) | "
            + " | ".join("—" if e is None else f"{at(e)}: {_loss_seeds(e)}" for e in cells)
            + " |"
        )
        out.append(versus("dp"))
    if any(rows[k]["diloco"].get("lr_below") for k in ks):  # the stall rule gave DiLoCo one
        cells = [rows[k]["diloco"].get("lr_below") for k in ks]
        out.append(
            f"| ablation: DiLoCo one grid point below its pick (a seed of its stalled; {steps} steps) | "
            + " | ".join(
                "—" if e is None else f"{at(e)}, outer lr {_num(e['outer_lr'])}: {_loss_seeds(e)}"
                for e in cells
            )
            + " |"
        )
    return out


def dp_warm(data: dict) -> str:
    """reproduce_diloco.py's part dp from the warm start, k = 4 and 8 side by side."""
    return _dp(data, "warm")


def dp_scratch(data: dict) -> str:
    """reproduce_diloco.py's part dp from scratch, k = 4 and 8 side by side."""
    return _dp(data, "scratch")


def _serial(row: dict) -> str:
    """The serial reference's loss and its difference to data parallel: 1.5926 (…), −9.1% vs data parallel."""
    e = row.get("serial") or {}
    if not (e.get("val_loss") or {}).get("mean"):
        return "not run"
    vs = e.get("vs_dp")
    return _loss(e["val_loss"]) + (f", {_pct(vs, 1)} vs data parallel" if vs is not None else "")


def _num(x: float) -> str:
    return f"{x:g}" if x != int(x) else f"{x:.1f}"


def _paired_by_seed(gap: float | None, p: dict | None) -> str:
    """**−2.9%** (paired by seed −3.0% … −2.8%)."""
    if gap is None or not p:
        return "not run"
    d = 2 if p["max"] - p["min"] < 1e-3 else 1  # a narrow range to a hundredth
    return f"**{_pct(gap, 1)}** (paired by seed {_pct(p['min'], d)} … {_pct(p['max'], d)})"


def _bytes_ratio(dp: int | None, diloco: int | None) -> str:
    if not dp or not diloco:
        return "not run"
    return f"{_size(dp)} / {_size(diloco)} = {dp / diloco:.1f}×"


def _paired1(p: dict | None, bold: bool = False, digits: int = 1) -> str:
    """A paired difference to a tenth of a percent (its mean to a hundredth when below 0.05%);
    `digits` 2: to a hundredth when below 1%."""
    if not p:
        return "not run"
    small = abs(p["mean"]) < (0.01 if digits == 2 else 5e-4)
    d = 2 if small else 1
    r = d if digits == 2 else 1  # the range: to a tenth, or as the mean in `digits` 2
    mean = _pct(p["mean"], d)
    return f"{f'**{mean}**' if bold else mean} ({_pct(p['min'], r)} … {_pct(p['max'], r)})"


def _size(n: int) -> str:
    """Megabytes: whole above 100, else to a tenth; thousands separated."""
    mb = n / 1e6
    return f"{mb:,.0f} MB" if mb >= 100 else f"{mb:.1f} MB"


def workers(data: dict) -> str:
    """Part workers: DiLoCo k ∈ {1, 2, 4, 8} at equal steps per worker, against k = 1."""
    w = data["workers"]
    out = [
        "| workers k | final val_loss, mean (min–max) | vs k = 1, paired by seed |",
        "| --- | --- | --- |",
        f"| `--method single` (AdamW, for reference) | {_loss(w['single']['val_loss'])} | "
        f"{_pct(w['single']['vs_baseline'], 1)} |",
    ]
    for k, e in w["by_workers"].items():
        vs = "baseline" if k == "1" else _paired1(e.get("vs_baseline_paired"))
        out.append(f"| {k} | {_loss(e['val_loss'])} | {vs} |")
    return "\n".join(out) + "\n"


def intervals(data: dict) -> str:
    """Part H: each H's rounds, bytes, loss, and its paired cost against H = 50 and data
    parallel; the H that ends lowest against data parallel in bold."""
    h = data["H"]
    dp = h["dp"]
    best = min(h["by_H"], key=lambda H: h["by_H"][H].get("vs_dp") or 0)
    out = [
        "| H | rounds | bytes sent per worker | final val_loss | vs H = 50, paired | "
        "vs data parallel, paired |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, (H, e) in enumerate(h["by_H"].items()):
        ratio = f"{e['bytes_ratio_vs_dp']:g}× fewer than dp" if i == 0 else f"{e['bytes_ratio_vs_dp']:g}×"
        loss = _loss(e["val_loss"])
        vs50 = "baseline" if H == h["baseline"].split("=")[1] else _paired1(e.get("vs_baseline_paired"))
        out.append(
            f"| {H} | {e['rounds']} | {_size(e['bytes_sent_per_worker'])} ({ratio}) | "
            + (f"**{loss}**" if H == best else loss)
            + f" | {vs50} | {_paired1(e.get('vs_dp_paired'), bold=H == best)} |"
        )
    steps = f"{h['steps_per_worker']:,}"
    out.append(
        f"| data parallel | {steps} steps of a {h['k']}× batch | {_size(dp['bytes_sent_per_worker'])} | "
        f"{_loss(dp['val_loss'])} | | baseline |"
    )
    return "\n".join(out) + "\n"


SHARDS = {
    "iid": "`iid`",
    "genre": "`genre` (each worker reads one or two genres)",
    "kmeans": "`kmeans` (~4,096-token parts of works clustered by TF-IDF)",
}


def shards(data: dict) -> str:
    """Part shards: non-i.i.d. shards against i.i.d."""
    out = [
        "| shards | final val_loss, mean (min–max) | vs i.i.d., paired by seed |",
        "| --- | --- | --- |",
    ]
    for name, e in data["shards"]["by_shards"].items():
        vs = "baseline" if name == "iid" else _paired1(e.get("vs_baseline_paired"))
        out.append(f"| {SHARDS.get(name, name)} | {_loss(e['val_loss'])} | {vs} |")
    return "\n".join(out) + "\n"


def drops(data: dict) -> str:
    """Part drop: each drop probability from scratch and warm-started, against no drops."""
    d = data["drop"]
    cold, warm = d["by_drop_prob"], d["by_drop_prob_warm"]
    out = [
        "| drop probability | from scratch: final val_loss | vs no drops, paired | "
        "warm start: final val_loss | vs no drops, paired |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p, e in cold.items():
        base = p == "0"
        cells = [_loss(e["val_loss"]), "baseline" if base else _paired1(e.get("vs_baseline_paired"))]
        w = warm.get(p)
        cells += (
            [_loss(w["val_loss"]), "baseline" if base else _paired1(w.get("vs_baseline_paired"))]
            if w
            else ["", ""]
        )
        out.append((f"| {p} | " + " | ".join(cells) + " |").replace("|  |", "| |").replace("|  |", "| |"))
    return "\n".join(out) + "\n"


OUTER = {"nesterov": "Nesterov, momentum 0.9", "sgd": "SGD, no momentum", "adam": "Adam, ε 0.1"}


def outer(data: dict) -> str:
    """Part outer: each outer optimizer's lr grid on seed 0, its pick over 3 seeds, against
    Nesterov; the baseline row and each grid's best in bold (lr 1 of SGD is FedAvg)."""
    o = data["outer"]
    out = [
        "| outer optimizer | lr grid on seed 0 (final val_loss) | best lr | final val_loss, 3 seeds | "
        "vs Nesterov, paired |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, e in o["by_optimizer"].items():
        grid = []
        for lr, v in e["lr_grid_seed0"].items():
            label = _num(float(lr)) + (" (FedAvg)" if name == "sgd" and float(lr) == 1 else "")
            cell = f"{label}: {_round(v, 4)}"
            grid.append(f"**{cell}**" if float(lr) == e["outer_lr"] else cell)
        base = name == "nesterov"
        title = f"**{OUTER[name].split(',')[0]}**,{OUTER[name].split(',', 1)[1]}" if base else OUTER[name]
        loss = _loss(e["val_loss"])
        p = e.get("vs_baseline_paired")
        vs = "baseline" if base else _paired1(p, bold=bool(p and abs(p["mean"]) >= 0.05), digits=2)
        loss = f"**{loss}**" if base else loss
        out.append(f"| {title} | {' · '.join(grid)} | {_num(e['outer_lr'])} | {loss} | {vs} |")
    return "\n".join(out) + "\n"


def single(data: dict) -> str:
    """Part single: DiLoCo with one worker against plain AdamW."""
    d = data["single"]
    return (
        "| run | final val_loss, mean (min–max) |\n| --- | --- |\n"
        f"| `--method single` (AdamW) | {_loss(d['single']['val_loss'])} |\n"
        f"| `--method diloco --workers 1` (H = 50, Nesterov 0.7) | {_loss(d['diloco_k1']['val_loss'])} |\n"
    )


DROP_RULES = {  # key of part drop's JSON -> the row's words
    "by_drop_prob": "k = 4, dropped worker goes on from its own parameters (above)",
    "by_drop_prob_after_global": "k = 4, `--after-drop global`",
    "by_drop_prob_k8": "k = 8 (the paper's workers), own parameters",
    "by_drop_prob_k8_after_global": "k = 8, `--after-drop global`",
}


def drop_rules(data: dict) -> str:
    """Part drop from scratch at p = 0.5: where the dropped worker goes on, and k = 4 or 8."""
    d = data["drop"]
    out = [
        "| p = 0.5, from scratch | no drops | p = 0.5 | vs no drops, paired |",
        "| --- | --- | --- | --- |",
    ]
    for key, words in DROP_RULES.items():
        base, e = d[key]["0"], d[key]["0.5"]
        out.append(
            f"| {words} | {_round(base['val_loss']['mean'], 4)} | {_loss(e['val_loss'])} | "
            f"{_paired1(e.get('vs_baseline_paired'), digits=2)} |"
        )
    return "\n".join(out) + "\n"


def drop_paper(data: dict) -> str:
    """Part drop in the paper's configuration (DROP_PAPER, stated before it ran): p = 0.5 against
    no drops, each mean saying how many seeds it is of while some have not run."""
    cols = "| final val_loss | vs no drops, paired | in perplexity (the claim's measure), paired |"
    if "paper_configuration" not in data["drop"]:  # part drop not run
        return f"| the paper's configuration {cols}\n| --- | --- | --- | --- |\n"
    d = data["drop"]["paper_configuration"]
    base, e = d["0"], d["0.5"]
    start = "warm start" if base["warm"] else "from scratch"
    loss, ppl = e.get("vs_baseline_paired"), e.get("vs_baseline_ppl_paired")
    return (
        f"| the paper's configuration: k = {base['k']}, {start}, `--after-drop {base['after']}` {cols}\n"
        "| --- | --- | --- | --- |\n"
        f"| no drops | {_loss_seeds(base)} | baseline | baseline |\n"
        f"| p = 0.5 | {_loss_seeds(e)} | {_on_seeds(e, base, loss) or _paired1(loss, digits=2)} "
        f"| {_on_seeds(e, base, ppl) or _paired1(ppl, digits=2)} |\n"
    )


def schedule(data: dict) -> str:
    """Part schedule: each workers schedule against constant workers of the same total."""
    d = data["schedule"]
    out = [
        "| schedule | worker-steps | final val_loss | constant workers, same total | "
        "schedule vs constant, paired |",
        "| --- | --- | --- | --- | --- |",
    ]
    shown = set()
    for name, e in d["by_schedule"].items():
        k = _num(e["mean_active_workers"]).removesuffix(".0")
        base = f"k = {k}: " + (
            _loss(e["baseline_val_loss"])
            if k not in shown
            else f"{_round(e['baseline_val_loss']['mean'], 4)}"
        )
        shown.add(k)
        out.append(
            f"| {name.replace('to', ' → ')} | {e['worker_steps']:,} | {_loss(e['val_loss'])} | {base} | "
            f"{_paired(e.get('vs_baseline_paired'))} |"
        )
    return "\n".join(out) + "\n"


def _lr_grid(data: dict, start: str) -> str:
    """Part dp's DiLoCo outer-lr grid on seed 0 for each k (the pick in bold)."""
    d = data["dp"]
    rows = {k: d["per_k"][str(k)][start] for k in d["k"] if start in d["per_k"][str(k)]}
    lrs = sorted({float(lr) for r in rows.values() for lr in r["diloco_lr_grid_seed0"]})
    model = "" if data.get("model", "nano") == "nano" else f"{data['model']}, "
    out = [
        f"| outer lr (seed 0, {model}{'from scratch' if start == 'scratch' else 'warm'}) | "
        + " | ".join(_num(lr) for lr in lrs)
        + " |",
        "| --- |" + " --- |" * len(lrs),
    ]
    for k, r in rows.items():
        grid = {float(lr): v for lr, v in r["diloco_lr_grid_seed0"].items()}
        cells = []
        for lr in lrs:
            v = grid.get(lr)
            cell = "" if v is None else str(_round(v, 4))
            cells.append(f"**{cell}**" if v is not None and lr == r["diloco_outer_lr"] else cell)
        out.append(f"| DiLoCo k = {k} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


EDGE = " (on the widened grid's edge)"  # a tuned lr still at its grid's edge after widening


def _diloco_grids(r: dict) -> tuple[str, str]:
    """A DiLoCo arm's two grids (its `tuning` report) and its picks, as table cells."""
    if r.get("inner_grid") is None:
        return "not made yet: waits for the picks it starts from", TUNING
    inner = f"inner lr at outer lr {r['inner_grid_at_outer_lr']:g}, warm-up {r['warmup']}: "
    inner += _grid(r["inner_grid"], r.get("inner_lr"))
    if r.get("inner_lr") is None:
        return inner, TUNING
    pick = f"inner lr {r['inner_lr']:g}" + (EDGE if r.get("inner_lr_at_grid_edge") else "")
    if r.get("grid") is None:
        return inner, pick + "; outer lr " + TUNING
    outer = f"; outer lr at inner lr {r['inner_lr']:g}: {_grid(r['grid'], r['pick'])}"
    pick += ", outer lr " + (TUNING if r["pick"] is None else f"{r['pick']:g}")
    return inner + outer, pick + (EDGE if r.get("lr_at_grid_edge") else "")


def tuning(data: dict) -> str:
    """Part dp's tuning (issue 36): every arm's grid on the tuning seed and split, and its pick."""
    t = data["dp"]["tuning"]
    out = [
        f"| arm (tuning seed {t['seed']}, tuning split) | grid: tuning loss at each lr (the pick in bold) "
        "| pick |",
        "| --- | --- | --- |",
    ]
    for arm, r in t["arms"].items():
        if "grids" in r:  # data parallel, single: an inner-lr grid per warm-up
            lr = r.get("lr")
            grid = "; ".join(
                f"warm-up {name.split()[-1]}: {_grid(g, lr if name == r['pick'] else None)}"
                for name, g in r["grids"].items()
            )
            pick = TUNING if lr is None else f"inner lr {lr:g}, warm-up {r['pick'].split()[-1]}"
            pick += EDGE if r.get("lr_at_grid_edge") else ""
        else:  # DiLoCo: its inner-lr grid at a fixed outer lr, then its outer-lr grid at that pick
            grid, pick = _diloco_grids(r)
        out.append(f"| {arm} | {grid} | {pick} |")
    for arm, g in t.get("ablations", {}).items():  # runs of an earlier rule, not used for a pick
        out.append(f"| ablation: {arm} | {_grid(g, None)} | not used |")
    return "\n".join(out) + "\n"


def _loss_seeds(e: dict) -> str:
    """`_loss`, saying how many of the planned seeds it is while some have not run:
    1.3164 (1.3110–1.3218; 2 of 3 seeds), or 1.3322 (seed 0; 1 of 3 seeds)."""
    text, stats, planned = _loss(e.get("val_loss")), e.get("val_loss") or {}, len(e.get("runs") or [])
    if stats.get("mean") is None or not _partial(e):
        return text
    if stats["n"] == 1:  # one seed: no range
        seed = next(iter(e.get("per_seed") or {"?": None}))
        return f"{_round(stats['mean'], 4)} (seed {seed}; 1 of {planned} seeds)"
    return f"{text[:-1]}; {stats['n']} of {planned} seeds)"


def _partial(e: dict) -> bool:
    """Some of a row's planned seeds have not run (or failed)."""
    n = (e.get("val_loss") or {}).get("n")
    return n is not None and n < len(e.get("runs") or [])


def _on_seeds(e: dict, base: dict, p: dict | None) -> str | None:
    """While either row has seeds to run, its paired gap `p` only on the seeds both have: +1.61%
    on seed 0 (paired; 1 of 3 seeds); None once both have run every seed, or with no seed in common."""
    if not (_partial(e) or _partial(base)) or not p:
        return None
    seeds = sorted(set(e.get("per_seed") or {}) & set(base.get("per_seed") or {}), key=int)
    if not seeds:
        return None
    which = f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + ", ".join(seeds)
    return f"{_pct(p['mean'], 2)} on {which} (paired; {len(seeds)} of {len(e.get('runs') or [])} seeds)"


def _gap_to_dp(e: dict, dp: dict) -> str:
    """A row's gap to data parallel: the mean's with its per-seed range, or, while either has
    seeds to run, only the seeds both have (`_on_seeds`)."""
    p = e.get("vs_dp_paired")
    return _on_seeds(e, dp, p) or _paired_by_seed(e.get("vs_dp"), p)


def h500(data: dict) -> str:
    """Part H500 (issue 36, reproduce_diloco_H500.json): data parallel and DiLoCo at each H over
    the paper's interval, each tuned on the tuning seed and split."""
    dp, steps = data["dp"], data["steps_per_worker"]
    t = dp.get("tuning") or {}
    dp_bytes = dp.get("bytes_sent_per_worker")
    tuned = f"inner lr {t['lr']:g}, warm-up {t['warmup']}" if t.get("lr") is not None else TUNING
    if t.get("grid"):  # its own grid at these steps, as DiLoCo's are shown
        tuned += f" (inner lr at warm-up {t['warmup']}: {_grid(t['grid'], t.get('lr'))})"
    out = [
        f"| run (warm, k = {data['k']}, {steps:,} steps per worker) | syncs | tuned | final val_loss "
        "| vs data parallel | data parallel's steps to reach it "
        "| bytes sent per worker, data parallel / this |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| data parallel | {steps:,} | {tuned} | {_loss_seeds(dp)} | — | — | — |",
    ]
    for H, e in data["by_H"].items():
        grids, tuned = _diloco_grids(e["tuning"]) if "tuning" in e else ("", TUNING)
        tuned = tuned if not grids else f"{tuned} ({grids})"
        out.append(
            f"| DiLoCo H = {H} | {steps // int(H):,} | {tuned} | {_loss_seeds(e)} | "
            f"{_gap_to_dp(e, dp)} | {_match(e)} | "
            f"{_bytes_ratio(dp_bytes, e.get('bytes_sent_per_worker'))} |"
        )
    return "\n".join(out) + "\n"


JITTER_NAMES = {
    "sync": "sync DiLoCo",
    "sync_dylu": "sync + DyLU (`--dylu`)",
    "sync_dylu_time": "sync + DyLU, rounds as deadlines",
    "naive": "naive",
    "poly": "Poly",
    "polythres": "PolyThres",
    "delaycomp": "delay compensation",
    "buffer": "buffer",
    "dn": "DN",
    "dn_dylu": "DN + DyLU (paper: by steps)",
    "dn_dylu_measured": "DN + DyLU, measured grace",
    "dn_dylu_time": "DN + DyLU by time (async's default)",
}


def _speedups(row: dict) -> str:
    """The smallest per-seed speedup, or how many seeds never reach sync's loss."""
    by_seed = row["speedup_by_seed"]
    if row["min_speedup"] is not None:
        return f"{row['min_speedup']:.2f}×"
    misses = sum(s is None for s in by_seed)
    return f"misses on {misses} of {len(by_seed)}"


def _jitter(data: dict, prefix: str) -> str:
    """async_jitter.py: every method against sync at each jitter level of one scenario: the mean
    paired % vs sync (range over seeds) and the smallest per-seed speedup."""
    levels = [f"j{j:g}" for j in data["jitters"]]
    head = " | ".join(f"jitter {j:g}: vs sync · min speedup" for j in data["jitters"])
    out = [f"| method | {head} |", "| --- |" + " --- |" * len(levels)]
    for name, label in JITTER_NAMES.items():
        cells = []
        for level in levels:
            row = data.get(f"{prefix}{level}", {}).get(name)
            if row is None:
                cells.append("not run")
                continue
            seeds = data[f"{prefix}seeds_{level}"]
            by_seed = row["vs_sync_pct_by_seed"]
            pct = {"mean": row["vs_sync_pct"] / 100, "min": min(by_seed) / 100, "max": max(by_seed) / 100}
            pick = name == data.get(f"{prefix}recommended_{level}")
            shown = "sync's loss" if name == "sync" else _paired(pct, bold=pick)
            short = "" if len(seeds) == len(data["seeds"]) else f" [{len(seeds)} seeds]"
            cells.append(f"{shown} · {_speedups(row)}{short}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def jitter_pick(data: dict) -> str:
    """async_jitter.py's pick per jitter level and scenario, and the best asynchronous method."""
    out = ["| jitter | from scratch | warm start | best async (scratch · warm) |"]
    out.append("| --- | --- | --- | --- |")
    for j in data["jitters"]:
        picks, best = [], []
        for prefix in ("", "warm_"):
            pick = data.get(f"{prefix}recommended_j{j:g}")
            picks.append(JITTER_NAMES[pick] if pick else "not run yet")
            b = data.get(f"{prefix}best_async_method_j{j:g}")
            if b:
                pct = _pct(data[f"{prefix}best_async_vs_sync_pct_j{j:g}"] / 100)
                sp = data[f"{prefix}best_async_min_speedup_j{j:g}"]
                best.append(f"`{b}` {pct}, min speedup {'never' if sp is None else f'{sp:.2f}×'}")
            else:
                best.append("not run yet")
        out.append(f"| {j:g} | {picks[0]} | {picks[1]} | {' · '.join(best)} |")
    return "\n".join(out) + "\n"


def jitter_probe(data: dict) -> str:
    """async_jitter.py's warm-start lr probe (seed 100, jitter 0.1): each method's loss per lr,
    its best in bold, and its best against sync's best."""
    out = ["| method | final val_loss by outer lr | best vs sync's best |", "| --- | --- | --- |"]
    probe = data.get("warm_lr_probe")
    if not probe:
        return "\n".join(out) + "\n| not run yet | | |\n"
    for m, row in probe.items():
        grid = _grid(row["final_val_loss"], row["best_outer_lr"])
        out.append(f"| {JITTER_NAMES[m]} | {grid} | {_pct(row['best_vs_sync_best_pct'] / 100)} |")
    return "\n".join(out) + "\n"


BYTES_NAMES = {
    "fp32": "DiLoCo fp32",
    "fp4_ef": "DiLoCo fp4 + EF",
    "topk10_ef": "DiLoCo chunked top-k 10% + EF",
    "topk3_2bit_ef": "DiLoCo chunked top-k 3%, 2-bit + EF",
    "sparseloco1": "SparseLoCo 1%",
    "sparseloco3": "SparseLoCo 3%",
    "sparseloco10": "SparseLoCo 10%",
}


def _grid(grid: dict, pick: float | None) -> str:
    """An outer-lr grid on seed 0, the pick in bold: 0.7: 1.7244, **1: 1.6898**, 1.4: 1.8333."""
    out = []
    for lr, loss in grid.items():
        cell = f"{lr}: {'–' if loss is None else _round(loss, 4)}"
        out.append(f"**{cell}**" if pick is not None and float(lr) == pick else cell)
    return ", ".join(out)


def _second(p: dict) -> tuple[str, str]:
    """A point's outer-lr cell and its second setting's cell (momentum m or SparseLoCo's β): at
    the targets' H the second grid (at the lr picked first) and, where the pick is not the
    default, the lr grid at the default before the one at the pick; elsewhere the pick it holds."""
    second, lrs = p.get("second") or {}, _grid(p["lr_grid_seed0"], p["outer_lr"])
    sym, pick = {"momentum": "m", "ef-decay": "β"}.get(second.get("setting"), "?"), second.get("pick")
    if "lr_grid_seed0_at_default" not in second:  # another H: the targets' H's pick
        return lrs, f"{sym} {_num(pick)} (H = 50's)" if pick is not None else "waits for H = 50"
    if pick is not None and pick != second["default"]:
        lrs = f"{_grid(second['lr_grid_seed0_at_default'], None)}; at {sym} {_num(pick)}: {lrs}"
    return lrs, (f"{sym} " + _grid(second["grid_seed0"], pick)) if second["grid_seed0"] else "—"


def bytes_points(data: dict) -> str:
    """bytes_to_loss.py: each (method, H) with a run: its outer-lr and second-setting grids on
    seed 0, its pick's final loss over seeds, the paired cost against fp32 at the same H, and its
    bytes to data parallel's final loss as a fraction of data parallel's (the worst seed's)."""
    out = [
        "| method | H | outer lr grid (seed 0: final loss) | momentum m / β grid (seed 0) "
        "| final val_loss (range) | vs fp32, same H | MB sent per worker | bytes to data parallel's loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    waiting = 0
    for p in sorted(data["points"].values(), key=lambda p: (p["H"], list(BYTES_NAMES).index(p["method"]))):
        if all(v is None for v in p["lr_grid_seed0"].values()):
            waiting += 1
            continue
        stats = p.get("val_loss")
        loss = "tuning" if p["outer_lr"] is None else _loss(stats)
        planned = data["seeds_at_target_H"] if p["H"] == 50 else data["seeds_elsewhere"]
        if stats and stats["n"] < planned:
            loss += f" [{stats['n']} seed{'s' if stats['n'] > 1 else ''} so far]"
        vs = "—" if p["method"] == "fp32" else _paired(p.get("vs_fp32_paired"))
        if p["reached"] is True:
            ratio = f"1/{round(1 / p['bytes_ratio'])}"
        else:
            ratio = {False: "not reached", None: "—"}[p["reached"]]
        mb = f"{p['bytes_sent_per_worker'] / 1e6:.2f}" if p.get("bytes_sent_per_worker") else "—"
        lrs, second = _second(p)
        out.append(
            f"| {BYTES_NAMES[p['method']]} | {p['H']} | {lrs} | {second} | {loss} | {vs} | {mb} | {ratio} |"
        )
    if waiting:
        out.append(f"| {waiting} more point{'s' if waiting > 1 else ''} not run yet | | | | | | | |")
    return "\n".join(out) + "\n"


TABLES: dict[str, Callable[[dict], str]] = {
    "bytes_points": bytes_points,
    "jitter_scratch": lambda data: _jitter(data, ""),
    "jitter_warm": lambda data: _jitter(data, "warm_"),
    "jitter_pick": jitter_pick,
    "jitter_probe": jitter_probe,
    "codec": codec,
    "pruning": pruning,
    "dp_warm": dp_warm,
    "workers": workers,
    "intervals": intervals,
    "shards": shards,
    "drops": drops,
    "outer": outer,
    "single": single,
    "drop_rules": drop_rules,
    "drop_paper": drop_paper,
    "schedule": schedule,
    "dp_scratch": dp_scratch,
    "lr_grid_warm": lambda data: _lr_grid(data, "warm"),
    "lr_grid_scratch": lambda data: _lr_grid(data, "scratch"),
    "tuning": tuning,
    "h500": h500,
    "dp_by_H": dp_by_H,
}


def render(text: str) -> str:
    """`text` with every marked table made again from its JSON."""

    def table(m: re.Match) -> str:
        name, source = m.group(1), m.group(2)
        if name not in TABLES:
            raise SystemExit(f"unknown table {name!r}: choose from {', '.join(TABLES)}")
        data = json.loads((ROOT / "benchmarks" / source).read_text())
        return f"<!-- table: {name} {source} -->\n{TABLES[name](data)}<!-- /table -->\n"

    return MARKED.sub(table, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a table is stale")
    args = ap.parse_args()
    stale = []
    for doc in sorted(DOCS.glob("*.md")):
        text = doc.read_text()
        new = render(text)
        if new != text:
            stale.append(doc.name)
            if not args.check:
                doc.write_text(new)
    verb = "stale" if args.check else "rewritten"
    print(f"tables {verb}: {', '.join(stale) or 'none'}", file=sys.stderr)
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
