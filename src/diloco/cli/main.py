"""The command line: `diloco VERB ...` parsed (cli/parser.py), handed to its verb (cli/train.py,
serve.py, use.py), a finished run reported, and errors turned into one line and an exit status.

diloco train --help
python -m diloco train --workers 8 --shards kmeans
"""

from __future__ import annotations

import os
import sys

from diloco.cli.parser import build_parser
from diloco.cli.plan import plan_command
from diloco.cli.serve import replay_command, serve_command, worker_command
from diloco.cli.train import train_command
from diloco.cli.use import plot_command, use_command
from diloco.config import TrainConfig
from diloco.errors import Interrupted, RunFailed, UserError

__all__ = ["build_parser", "main"]


def report(summary: dict) -> None:
    """Print a run's summary (rank 0 alone, under torchrun), or how to continue a stopped one."""
    from diloco.rundir.summary import format_summary

    if "rank" in summary:  # a rank other than 0 under torchrun: rank 0 reports
        return
    if "stopped_after" in summary:
        print(
            f"stopped after round {summary['stopped_after']}; "
            f"continue with: diloco train --resume {summary['run_dir']}"
        )
    else:
        print(format_summary(summary))


def _ran(ran: tuple[TrainConfig, dict] | None) -> int:
    """The end of diloco train or serve: the report of the run (none for a finished run resumed)."""
    if ran is None:
        return 0
    cfg, summary = ran
    report(summary)
    if cfg.runtime == "collective":
        # Skip interpreter teardown: gloo's threads can still be joinable when C++ statics are
        # destroyed and abort a finished rank ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # gRPC's own log lines (an info line per failed TLS handshake, an error line for a port in
    # use) would repeat what diloco says in one sentence; GRPC_VERBOSITY=ERROR (or INFO, DEBUG) in
    # the environment brings them back
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        if args.command == "train":
            return _ran(train_command(args))
        if args.command == "plan":
            return plan_command(args)
        if args.command == "plot":
            return plot_command(args)
        if args.command == "serve":
            return _ran(serve_command(args))
        if args.command == "worker":
            return worker_command(args)
        if args.command == "replay":
            return replay_command(args)
        if args.command in ("eval", "generate", "export"):
            return use_command(args)
    except UserError as e:
        print(f"diloco: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:  # a non-finite loss, diverged or dead ranks: the checkpoints are intact
        print(f"diloco: error: {e}", file=sys.stderr)
        return 3
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"diloco: {str(e) or 'interrupted (Ctrl-C)'}", file=sys.stderr)
        return 130
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
