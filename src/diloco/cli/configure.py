"""From the command line to a TrainConfig: the settings given as flags, put on top of a TOML file's
values or (--resume) a saved run's config, validated once; and whether --resume has work left.

    from diloco.cli.configure import given_settings, with_flags
    cfg = with_flags(load_toml("c.toml"), given_settings(args), where="c.toml")
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from diloco import settings
from diloco.config import TrainConfig, from_dict, merge
from diloco.errors import UserError

# Settings `diloco train --resume DIR` may change: where and how fast the run continues, never its results.
RESUME_OVERRIDES = ("runtime", "threads", "sim.procs", "timeout_s", "data.cache_dir")
# ... and those `diloco serve --resume DIR` may change (how long the server waits for workers)
SERVE_RESUME_OVERRIDES = (
    "threads",
    "round_timeout_s",
    "worker_timeout_s",
    "max_inflight_pushes",
    "max_inflight_downloads",
    "max_update_norm_ratio",
    "max_staleness",
)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (their dests are the settings' dotted paths): {path: value}."""
    flagged = (s.path for s in settings.walk(TrainConfig) if s.flag)
    return {path: getattr(args, path) for path in flagged if getattr(args, path) is not None}


def with_flags(values: dict[str, Any], flags: dict[str, Any], where: str) -> TrainConfig:
    """The config of nested `values` (a TOML file's, a saved run's) with `flags` ({dotted path:
    value}) on top, validated once; its errors name `where`. Every command builds its config here."""
    for path, value in flags.items():
        values = merge(values, settings.nest(path, value))
    return from_dict(values, where=where)


def resumed_run(run_dir: Path, flags: dict[str, Any], allowed: tuple[str, ...], config_file: Path | None):
    """The config `--resume run_dir` continues with: its config.json under `resumed_config`'s rules."""
    from diloco.rundir import load_run_config

    where = f"{run_dir / 'config.json'} with the flags"
    return resumed_config(load_run_config(run_dir), flags, allowed, where=where, config_file=config_file)


def resumed_config(
    saved: TrainConfig,
    flags: dict[str, Any],
    allowed: tuple[str, ...],
    *,
    where: str,
    config_file: Path | None = None,
) -> TrainConfig:
    """The config a resumed run continues with: `saved` (its config.json), changed only by the flags
    of `allowed` paths; a flag equal to the run's value changes nothing, any other (or a
    `config_file`) is refused. A run moving runtimes drops the settings of the one it leaves."""

    def same(given: Any, kept: Any) -> bool:  # a flag's value and config.json's (lists: tuples)
        if isinstance(given, list | tuple) and isinstance(kept, list | tuple):
            return len(given) == len(kept) and all(map(same, given, kept))
        return str(given) == str(kept) if isinstance(given, Path) or isinstance(kept, Path) else given == kept

    flags = {  # a flag that says what the run already has changes nothing
        p: v for p, v in flags.items() if p in allowed or not same(v, settings.get(saved, p))
    }
    refused = [
        f"{settings.find(TrainConfig, p).flag} {v} where the run has {settings.get(saved, p)}"
        for p, v in flags.items()
        if p not in allowed
    ]
    refused += ["--config"] if config_file is not None else []
    if refused:
        allowed_flags = ", ".join(settings.find(TrainConfig, p).flag for p in allowed)
        raise UserError(
            f"--resume continues a run with its saved config.json and allows only {allowed_flags} besides; "
            f"drop the settings that change it ({'; '.join(refused)})."
        )
    runtime = flags.get("runtime", saved.runtime)
    # Moving runtimes: the settings of the runtime the run leaves (its clock, its buckets and
    # timeout) never change a sync run's parameters, so they go back to their defaults; so do
    # those it shares with the new one but that mean another thing there (--speeds: simulated
    # seconds in the simulator, padding of real steps under torchrun).
    moved = runtime != saved.runtime

    def elsewhere(s: settings.Setting) -> bool:  # a setting of another runtime than this one alone
        needs = settings.conditions(s.meta.needs)
        return any(p == "runtime" and not (op == "==" and v == runtime) for p, op, v in needs)

    left = {s.path: s.default for s in settings.walk(TrainConfig) if moved and elsewhere(s)}
    return with_flags(saved.to_dict(), left | flags, where)


def finished(run_dir: Path) -> bool:
    """A finished run (`rundir.finished`) is left as it is: --resume says so (rank 0 alone, under
    torchrun) and exits 0, with nothing left to do, rather than redo its final evaluation."""
    from diloco import rundir

    if not rundir.finished(run_dir):
        return False
    if os.environ.get("RANK", "0") == "0":
        print(f"{run_dir} is a finished run (its summary.json says how it ended); nothing to resume.")
    return True
