"""The command line: `diloco train` (thin: parse, build the config, run).

diloco train --help
python -m diloco train --workers 8 --shards kmeans
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from diloco.config import METHODS, MODEL_PRESETS, OUTER_OPTS, SHARDINGS, from_dict, load_toml, merge
from diloco.errors import Interrupted, ReplicaMismatch, UserError


def _speeds(text: str) -> tuple[float, ...]:
    from diloco.runtime.clock import parse_speeds

    try:
        return tuple(parse_speeds(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--speeds wants positive seconds per step separated by commas, got {text!r}"
        ) from None


# flag dest -> (config path, type or action, help)
TRAIN_FLAGS: dict[str, tuple[str, Any, str]] = {
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
    "threads": ("threads", int, "intra-op threads of the main process (default 0: every core)"),
    "target_loss": ("target_loss", float, "report when the validation loss first reaches this"),
    "runtime": ("runtime", str, "sim (one process) | collective (under torchrun; see docs/distributed.md)"),
    "procs_per_worker": ("procs_per_worker", int, "collective: ranks per worker doing data parallel (1)"),
    "bucket_mb": ("bucket_mb", float, "collective: outer sync bucket size in MB (25)"),
    "drop_prob": ("drop_prob", float, "lose each outer_grad with this probability (default 0)"),
    "workers_schedule": ("workers_schedule", str, "active workers over training, e.g. 0:4,0.5:8"),
    # the simulator's clock and processes
    "speeds": ("sim.speeds", _speeds, "seconds per inner step per worker, e.g. 0.58,0.75,1.51,3.33"),
    "heterogeneity": ("sim.heterogeneity", str, "none | slight | moderate | very (1x, 1.5x, 3x, 6x spread)"),
    "speed_jitter": ("sim.speed_jitter", float, "per-round relative jitter of time per step (default 0)"),
    "slowdown": ("sim.slowdowns", "append", "W:FACTOR@START-END, e.g. 2:4@100-200 (repeatable)"),
    "bandwidth_mbps": ("sim.bandwidth_mbps", float, "network bandwidth for pulls and pushes (0: unlimited)"),
    "latency_ms": ("sim.latency_ms", float, "latency added to every pull and push (default 0)"),
    "procs": ("sim.procs", int, "processes computing workers, one thread each (default 0: one per core)"),
    # the asynchronous server
    "async_rule": ("server.rule", str, "dn | naive | buffer | poly | polythres | delaycomp (default dn)"),
    "dn_buffer": ("server.buffer", int, "N for dn and buffer (default 0: the number of workers)"),
    "dn_c": ("server.dn_c", float, "c of delayed Nesterov, in [0, 1/N] (default 0)"),
    "poly_threshold": ("server.poly_threshold", int, "polythres drops updates staler than this (10)"),
    "delaycomp_lambda": ("server.delaycomp_lambda", float, "lambda of delay compensation (0.5)"),
    "dylu": ("server.dylu", bool, "dynamic local updates from measured speeds"),
    "dylu_oracle": ("server.dylu_oracle", bool, "dynamic local updates from the true speed profile"),
    "dylu_alpha": ("server.dylu_alpha", float, "weight of the newest speed measurement (0.5)"),
    "shard_sampling": ("server.shard_sampling", bool, "hand out shards by how far behind they are"),
    "grace_s": ("server.grace_s", float, "grace period in simulated seconds (default 0; inf = sync)"),
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
    train = sub.add_parser(
        "train", help="train with DiLoCo, asynchronous Local-SGD or a baseline (simulator or torchrun)"
    )
    train.add_argument("--config", type=Path, help="TOML file of settings; flags override it")
    for dest, (_, kind, help_) in TRAIN_FLAGS.items():
        flag = "--" + dest.replace("_", "-")
        if kind is bool:
            train.add_argument(flag, dest=dest, action="store_true", default=None, help=help_)
        elif kind == "append":
            train.add_argument(flag, dest=dest, action="append", help=help_)
        else:
            train.add_argument(flag, dest=dest, type=kind, help=help_)
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
    plot = sub.add_parser("plot", help="validation loss of several runs on one figure")
    plot.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    plot.add_argument(
        "--x",
        default="sim_time_s",
        help="sim_time_s | inner_steps | outer_updates | bytes_sent (default sim_time_s)",
    )
    plot.add_argument(
        "--out", type=Path, default=Path("loss.png"), help="PNG file to write (default loss.png)"
    )
    plot.add_argument("--labels", help="comma-separated legend labels, one per run (default: from configs)")
    plot.add_argument("--title", help="figure title")
    plot.add_argument(
        "--ymax", type=float, help="upper limit of the loss axis (a diverged run hides the rest)"
    )
    return parser


def _plot(args: argparse.Namespace) -> int:
    from diloco.plots import plot_runs

    labels = args.labels.split(",") if args.labels else None
    print(plot_runs(args.runs, x=args.x, out=args.out, labels=labels, title=args.title, ymax=args.ymax))
    return 0


def _train(args: argparse.Namespace) -> int:
    from diloco.train import load_run_config, train

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
        if (
            values.get("runtime") == "collective"
            and "num_workers" not in values
            and "WORLD_SIZE" in os.environ
        ):
            # under torchrun the number of workers follows from the ranks started
            values["num_workers"] = int(os.environ["WORLD_SIZE"]) // int(values.get("procs_per_worker", 1))
        cfg = from_dict(values, where=str(args.config) if args.config else "the flags")
    if args.stop_after is not None and args.stop_after < 1:
        raise UserError(f"--stop-after must be a round >= 1, got {args.stop_after}.")
    summary = train(cfg, resume=args.resume, stop_after=args.stop_after, progress=args.progress)
    if cfg.runtime == "collective":
        _report(summary)
        # Skip interpreter teardown: gloo's threads can still be joinable when C++ statics are
        # destroyed and abort a finished rank ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _report(summary)
    return 0


def _report(summary: dict) -> None:
    from diloco.summary import format_summary

    if "rank" in summary:  # a rank other than 0 under torchrun: rank 0 reports
        return
    if "stopped_after" in summary:
        print(
            f"stopped after round {summary['stopped_after']}; "
            f"continue with: diloco train --resume {summary['run_dir']}"
        )
    else:
        print(format_summary(summary))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "plot":
            return _plot(args)
    except UserError as e:
        print(f"diloco: error: {e}", file=sys.stderr)
        return 2
    except ReplicaMismatch as e:
        print(f"diloco: error: {e}", file=sys.stderr)
        return 3
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"diloco: {e or 'interrupted'}", file=sys.stderr)
        return 130
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
