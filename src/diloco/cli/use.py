"""The verbs that use finished runs: diloco eval, generate and export (run/use.py) and diloco plot
(cli/plots.py).

    from diloco.cli.use import use_command
    use_command(build_parser().parse_args(["eval", "runs/x", "--json"]))
"""

from __future__ import annotations

import argparse
import os

from diloco.errors import UserError


def use_command(args: argparse.Namespace) -> int:
    """Run `diloco eval`, `generate` or `export` on a finished run: 0."""
    from diloco.run import use
    from diloco.run.threads import set_threads
    from diloco.rundir.metrics import to_json

    threads = getattr(args, "threads", 0)  # export has no --threads: it computes nothing
    if threads < 0:
        raise UserError(f"--threads must be 0 (every core) or more, got {threads}; use --threads 0.")
    set_threads(threads or len(os.sched_getaffinity(0)))
    if args.command == "eval":
        result = use.evaluate_run(args.run, args.data, text_field=args.text_field, progress=args.progress)
        if args.json:
            print(to_json(result))
        else:
            loss, ppl, tokens = result["val_loss"], result["val_ppl"], result["tokens"]
            loss_s = "nan" if loss is None else f"{loss:.4f}"  # a diverged model, as summary.txt says it
            ppl_s = "overflow" if ppl is None else f"{ppl:.3f}"
            print(f"val_loss {loss_s}   val_ppl {ppl_s}   tokens {tokens:,}")
    elif args.command == "generate":
        print(
            use.generate(
                args.run,
                args.prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                seed=args.seed,
            )
        )
    else:
        print(f"exported to {use.export(args.run, args.out)}")
    return 0


def plot_command(args: argparse.Namespace) -> int:
    """Run `diloco plot`: write the figure, print its path, 0."""
    from diloco.cli.plots import plot_runs

    labels = args.labels.split(",") if args.labels else None
    print(plot_runs(args.runs, x=args.x, out=args.out, labels=labels, title=args.title, ymax=args.ymax))
    return 0
