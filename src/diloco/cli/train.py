"""diloco train: the run's config from a TOML file and the flags, or (--resume) from the run's own
config.json, then the run on the simulator or under torchrun (the server is diloco serve).

    from diloco.cli.train import train_command
    cfg, summary = train_command(build_parser().parse_args(["train", "--workers", "2"]))
"""

from __future__ import annotations

import argparse
import os

from diloco.cli.configure import RESUME_OVERRIDES, finished, given_settings, resumed_run, with_flags
from diloco.config import TrainConfig, load_toml
from diloco.errors import UserError


def train_command(args: argparse.Namespace) -> tuple[TrainConfig, dict] | None:
    """Run `diloco train`: its config and summary, or None where --resume finds the run finished."""
    from diloco.run.train import train

    flags = given_settings(args)
    not_here = "the server runtime is started by diloco serve (see docs/server.md), not diloco train."
    if flags.get("runtime") == "server":
        raise UserError(not_here)
    if args.resume is not None:
        cfg = resumed_run(args.resume, flags, RESUME_OVERRIDES, config_file=args.config)
        if cfg.runtime == "server":
            raise UserError(
                f"{args.resume} is a parameter server run; continue it with diloco serve --resume."
            )
        if finished(args.resume):
            return None
    else:
        values = load_toml(args.config) if args.config is not None else {}
        runtime = flags.get("runtime", values.get("runtime"))
        if runtime == "server":
            raise UserError(not_here)
        if (
            runtime == "collective"
            and "num_workers" not in values
            and "num_workers" not in flags
            and "WORLD_SIZE" in os.environ
        ):
            # under torchrun the number of workers follows from the ranks started (a bad
            # procs_per_worker is left to the config's own check)
            m = flags.get("procs_per_worker", values.get("procs_per_worker", 1))
            if isinstance(m, int) and not isinstance(m, bool) and m >= 1:
                values["num_workers"] = int(os.environ["WORLD_SIZE"]) // m
        cfg = with_flags(values, flags, where=str(args.config) if args.config else "the flags")
    if args.stop_after is not None and not 1 <= args.stop_after < cfg.rounds:
        raise UserError(
            f"--stop-after must be a round from 1 to {cfg.rounds - 1} (the run has {cfg.rounds} rounds), "
            f"got {args.stop_after}; choose one of them or drop it."
        )
    return cfg, train(cfg, resume=args.resume, stop_after=args.stop_after, progress=args.progress)
