"""diloco plan: a run's wall time, compute utilisation and bytes, predicted by the simulator's clock
without training (run/plan.py), for one configuration or a sweep of them.

    diloco plan --workers 8 --inner-steps 100 --step-s 0.3 --link-mbps 1000
    diloco plan --model 10b --workers 64 --step-s 0.8 --link-mbps 10000 \\
        --sweep H=50,100,500 --sweep codec=fp32,fp4
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from typing import Any

from diloco import settings
from diloco.cli.configure import given_settings, with_flags
from diloco.config import TrainConfig, load_toml
from diloco.config.parsers import parse_speeds
from diloco.errors import UserError

SHORT = {"H": "inner_steps", "k": "num_workers"}  # --sweep's short names


def _numbers(text: str, flag: str) -> list[float]:
    try:
        return parse_speeds(text)
    except ValueError:
        raise UserError(f"{flag} wants positive numbers separated by commas, got {text!r}.") from None


def _rates(text: str, flag: str) -> list[float]:
    """Link rates: numbers ≥ 0 (0: unlimited) separated by commas."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise UserError(f"{flag} wants Mbit/s (0: unlimited) separated by commas, got {text!r}.")
    return values


def _refuse_pairs(
    args: argparse.Namespace,
    flags: dict[str, Any],
    axes: list[tuple[str, str, list[str]]],
    values: dict[str, Any],
) -> None:
    """One sentence for settings that would silently override each other, whether given as flags,
    swept, or read from the --config file (`values`)."""
    swept = {p for p, _, _ in axes}
    for path in ("runtime", "sim.speeds", "sim.heterogeneity"):
        if path in swept:
            raise UserError(f"--sweep cannot vary {path.split('.')[-1]}: run diloco plan once for each.")

    def given(path: str, flag: str) -> str | None:
        """How `path` was given (its flag, a sweep, or the config file's key), or None."""
        section, _, key = path.partition(".")
        if path in flags or path in swept:
            return flag
        table = values.get(section)
        return f"{args.config}'s [{section}] {key}" if isinstance(table, dict) and key in table else None

    given_steps = "--step-s" if args.step_s is not None else "--probe" if args.probe else None
    for path, flag in (("sim.speeds", "--speeds"), ("sim.heterogeneity", "--heterogeneity")):
        if given_steps and (other := given(path, flag)):
            raise UserError(f"give {given_steps} or {other}, not both.")
    links = "--link-mbps" if args.link_mbps is not None else "--probe-link" if args.probe_link else None
    if links and (other := given("sim.bandwidth_mbps", "--bandwidth-mbps")):
        raise UserError(f"give {links} or {other}, not both.")
    if args.probe_link and (other := given("sim.latency_ms", "--latency-ms")):
        raise UserError(f"--probe-link measures the latency: drop {other}.")
    if args.rounds_simulated < 1:
        raise UserError(f"--rounds-simulated must be at least 1, got {args.rounds_simulated}.")


def _per_worker(values: list[float], k: int, flag: str) -> list[float]:
    if len(values) not in (1, k):
        raise UserError(f"{flag} gives {len(values)} values for {k} workers; give one, or one per worker.")
    return values * k if len(values) == 1 else values


def _sweep_axes(specs: list[str]) -> list[tuple[str, str, list[str]]]:
    """--sweep KEY=V1,V2,...: (the setting's path, the name shown, its values as text)."""
    axes = []
    for spec in specs:
        key, _, values = spec.partition("=")
        key = key.strip().lstrip("-")
        path = SHORT.get(key)
        if path is None:
            found = [s for s in settings.walk(TrainConfig) if s.flag == f"--{key}" or s.path == key]
            if not found:
                raise UserError(
                    f"--sweep {spec!r}: {key!r} is no setting; use a flag's name (inner-steps, codec, "
                    "fragments, workers, overlap-steps, ...) or H."
                )
            path = found[0].path
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not items:
            raise UserError(f"--sweep {spec!r} gives no values; write KEY=V1,V2,...")
        if any(p == path for p, _, _ in axes):
            raise UserError(f"--sweep varies {key} twice; give all its values once: --sweep {key}=V1,V2,...")
        axes.append((path, key, items))
    return axes


def _parsed(path: str, text: str) -> Any:
    """A sweep value as its setting's flag would read it."""
    s = settings.find(TrainConfig, path)
    try:
        if s.meta.parse is not None:
            return s.meta.parse(text)
        if settings.is_switch(s.type):
            word = text.lower()
            if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(text)
            return word in ("1", "true", "yes", "on")
        return s.type(text) if isinstance(s.type, type) else text
    except ValueError:
        kind = " (on or off)" if settings.is_switch(s.type) else ""
        raise UserError(f"--sweep: {text!r} is not a value of {s.flag or path}{kind}.") from None


def plan_command(args: argparse.Namespace) -> int:
    from diloco.run.plan import Shapes, plan
    from diloco.run.probe import probe_step_s

    flags = given_settings(args)
    values = load_toml(args.config) if args.config is not None else {}
    # what runs it: a parameter server (a star of pulls and pushes; async's first job is its
    # probe alone), torchrun (a ring of collectives) or the simulator itself (run/plan.py)
    runtime = flags.pop("runtime", values.pop("runtime", "server"))
    where = str(args.config) if args.config else "the flags"
    axes = _sweep_axes(args.sweep or [])
    _refuse_pairs(args, flags, axes, values)
    toml_speeds = values.get("sim", {}).get("speeds") if isinstance(values.get("sim"), dict) else None
    if toml_speeds and "sim.speeds" not in flags and args.step_s is None and not args.probe:
        flags["sim.speeds"] = tuple(toml_speeds)  # a TOML file's step times
    if args.step_s is None and not args.probe and "sim.speeds" not in flags:
        raise UserError(
            "diloco plan needs each worker's seconds per inner step: give --step-s S[,S,...] (one value: "
            "every worker), or --probe to time a few steps of the model on this machine."
        )
    if args.step_s is not None and args.probe:
        raise UserError("give --step-s or --probe, not both.")
    base = with_flags(values, {p: v for p, v in flags.items() if p != "sim.speeds"}, where)
    combos = list(itertools.product(*[[(p, _parsed(p, v)) for v in vs] for p, _, vs in axes]))
    step_s = None if args.step_s is None else _numbers(args.step_s, "--step-s")
    if args.probe:
        step_s = [probe_step_s(base)]
        print(f"diloco plan: --probe: {step_s[0]:.4g} s per inner step on this machine", file=sys.stderr)
    link, measured = None if args.link_mbps is None else _rates(args.link_mbps, "--link-mbps"), None
    if args.probe_link is not None:
        if link is not None:
            raise UserError("give --link-mbps or --probe-link, not both.")
        measured = _probe_link(args)
        link = [min(measured["down_mbps"], measured["up_mbps"])]
        flags["sim.latency_ms"] = measured["latency_ms"]
    shapes, rows = Shapes(), []
    for combo in combos:
        chosen = dict(combo)
        cfg = with_flags(values, {p: v for p, v in flags.items() if p != "sim.speeds"} | chosen, where)
        k = cfg.num_workers
        speeds = flags.get("sim.speeds") if step_s is None else tuple(_per_worker(step_s, k, "--step-s"))
        cfg = with_flags(
            values, flags | chosen | {"sim.speeds": tuple(_per_worker(list(speeds), k, "--speeds"))}, where
        )
        links = None if link is None else _per_worker(link, k, "--link-mbps")
        row = plan(cfg, links=links, rounds_simulated=args.rounds_simulated, shapes=shapes, runtime=runtime)
        if measured is not None:  # what the plan used: every worker's link, both ways, and latency
            row["probed_link"] = measured
        if axes:
            row = {"swept": {name: v for (_, name, _), (_, v) in zip(axes, combo, strict=True)}, **row}
        rows.append(row)
        if not args.json:
            print(describe(row, cfg))
    if args.json:
        print(json.dumps(rows if axes else rows[0], indent=1))
    return 0


def _probe_link(args: argparse.Namespace) -> dict[str, float]:
    """--probe-link: the link to a running server, measured (run/link.py's `probe_link`)."""
    from diloco.run.link import Link, probe_link
    from diloco.runtime.server import security

    for path in (args.token_file, args.tls_ca):
        if path is not None and not path.is_file():
            raise UserError(f"{path} does not exist; give the path of the run's file.")
    link = Link(
        args.probe_link, retry_s=10.0, token=security.given_token(args.token_file), tls_ca=args.tls_ca
    )
    try:
        measured = probe_link(link)
    finally:
        link.close()
    print(
        f"diloco plan: --probe-link {args.probe_link}: {measured['latency_ms']:.3g} ms round trip, "
        f"{measured['down_mbps']:.4g} Mbit/s down, {measured['up_mbps']:.4g} up",
        file=sys.stderr,
    )
    return measured


def _mb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def _duration(s: float) -> str:
    return f"{s:.4g} s" + (f" ({s / 3600:.3g} h)" if s >= 3600 else f" ({s / 60:.3g} min)" if s >= 60 else "")


def describe(row: dict[str, Any], cfg: TrainConfig) -> str:
    """The prediction in a few lines of text."""
    swept = ", ".join(f"{k} = {v}" for k, v in row.get("swept", {}).items())
    head = f"{cfg.method}, {row['workers']} workers, H = {row['inner_steps']}, {row['rounds']} rounds, "
    head += f"codec {row['codec']}" + (f", {row['fragments']} fragments" if row["fragments"] > 1 else "")
    util = row["utilisation"]
    per = " ".join(f"{u:.2f}" for u in util["per_worker"][:16]) + (
        " ..." if len(util["per_worker"]) > 16 else ""
    )
    sent, received = row["bytes_per_worker"]["sent"], row["bytes_per_worker"]["received"]
    need = [b for b in row.get("bandwidth_for_95pct_mbps", []) if b is not None]
    lines = [
        f"plan: {swept + ': ' if swept else ''}{head}"
        + (
            f" ({row['rounds_simulated']} simulated, scaled)"
            if row["rounds_simulated"] < row["rounds"]
            else ""
        ),
        f"  wall time    {_duration(row['wall_time_s'])}; {row['round_time_s']:.4g} s per round",
        f"  utilisation  mean {util['mean']:.3f}; per worker {per}",
        f"  per worker   sent {_mb(max(sent))}, received {_mb(max(received))} (the most of any worker)",
    ]
    if need:
        lines.append(f"  95% needs    {max(need):.4g} Mbit/s per link (the most any worker needs)")
    if row.get("speedup_vs_sync") is not None:
        lines.append(
            f"  async        {row['speedup_vs_sync']:.3g}x sync DiLoCo's speed at equal local steps; "
            f"mean staleness {row['mean_staleness']:.2f}"
        )
    return "\n".join(lines)
