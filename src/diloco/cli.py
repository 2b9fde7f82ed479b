"""The command line: `diloco train` (thin: parse, build the config, run).

diloco train --help
python -m diloco train --workers 8 --shards kmeans
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from diloco.config import METHODS, MODEL_PRESETS, OUTER_OPTS, SHARDINGS, from_dict, load_toml, merge
from diloco.errors import UserError

# flag dest -> (config path, help)
TRAIN_FLAGS: dict[str, tuple[str, type, str]] = {
    "method": ("method", str, f"{' | '.join(METHODS)} (default diloco)"),
    "workers": ("num_workers", int, "number of workers k (default 4)"),
    "inner_steps": ("inner_steps", int, "inner steps per round H (default 50)"),
    "rounds": ("rounds", int, "rounds (outer steps) to run (default 6)"),
    "model": ("model.name", str, f"model preset: {' | '.join(MODEL_PRESETS)} (default nano)"),
    "batch_size": ("data.batch_size", int, "sequences per inner step per worker (default 16)"),
    "seq_len": ("model.seq_len", int, "tokens per sequence (default: the preset's)"),
    "shards": ("data.shards", str, f"{' | '.join(SHARDINGS)} (default iid)"),
    "inner_lr": ("inner.lr", float, "peak inner AdamW learning rate (default 1e-3)"),
    "outer_opt": ("outer.opt", str, f"{' | '.join(OUTER_OPTS)} (default nesterov)"),
    "outer_lr": ("outer.lr", float, "outer learning rate (default 0.7)"),
    "outer_momentum": ("outer.momentum", float, "outer momentum (default 0.9)"),
    "seed": ("seed", int, "seed for initialisation, shards and batches (default 0)"),
    "out": ("out", str, "run directory (default runs/<method>-k<k>-H<H>-s<seed>)"),
    "eval_every": ("eval_every", int, "inner steps between evaluations (default 50)"),
    "checkpoint_every": ("checkpoint_every", int, "rounds between checkpoints (default 0: none)"),
    "threads": ("threads", int, "intra-op threads (default 0: every available core, measured fastest)"),
}


def _nest(path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    return {head: _nest(rest, value) if rest else value}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        self.exit(2, f"diloco: error: {message}; see '{self.prog} --help'.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diloco", description="Low-communication training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train with DiLoCo or a baseline in the simulator")
    train.add_argument("--config", type=Path, help="TOML file of settings; flags override it")
    for dest, (_, kind, help_) in TRAIN_FLAGS.items():
        train.add_argument("--" + dest.replace("_", "-"), dest=dest, type=kind, help=help_)
    train.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue a run from its latest checkpoint, bit for bit",
    )
    train.add_argument(
        "--stop-after",
        type=int,
        metavar="ROUND",
        help="save a checkpoint after this round and stop (continue with --resume)",
    )
    train.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: when stderr is a terminal)",
    )
    return parser


def _train(args: argparse.Namespace) -> int:
    from diloco.train import format_summary, load_run_config, train

    overrides = {dest: getattr(args, dest) for dest in TRAIN_FLAGS if getattr(args, dest) is not None}
    if args.resume is not None:
        if overrides or args.config is not None:
            raise UserError(
                "--resume continues a run with its saved config.json; drop the other settings "
                f"({', '.join('--' + d.replace('_', '-') for d in overrides) or '--config'})."
            )
        cfg = load_run_config(args.resume)
    else:
        values = load_toml(args.config) if args.config is not None else {}
        for dest, value in overrides.items():
            values = merge(values, _nest(TRAIN_FLAGS[dest][0], value))
        cfg = from_dict(values, where=str(args.config) if args.config else "the flags")
    if args.stop_after is not None and args.stop_after < 1:
        raise UserError(f"--stop-after must be a round >= 1, got {args.stop_after}.")
    summary = train(cfg, resume=args.resume, stop_after=args.stop_after, progress=args.progress)
    if "stopped_after" in summary:
        print(
            f"stopped after round {summary['stopped_after']}; "
            f"continue with: diloco train --resume {summary['run_dir']}"
        )
    else:
        print(format_summary(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
    except UserError as e:
        print(f"diloco: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "diloco: interrupted; continue from the last checkpoint with --resume RUN_DIR.", file=sys.stderr
        )
        return 130
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
