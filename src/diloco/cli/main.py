"""The command line: `diloco train` (thin: parse, build the config, run).

diloco train --help
python -m diloco train --workers 8 --shards kmeans
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import typing
from pathlib import Path
from typing import Any

from diloco import settings
from diloco.cli.plots import X_AXES
from diloco.config import FLAG_GROUPS, TrainConfig, from_dict, load_toml, merge
from diloco.errors import Interrupted, RunFailed, UserError

# Settings `--resume DIR` may change: where and how fast the run continues, never its results.
RESUME_OVERRIDES = ("runtime", "threads", "sim.procs", "timeout_s", "data.cache_dir")
PROGRESS = "show a progress bar (default: when stderr is a terminal)"
USE_THREADS = "intra-op threads (default 0: every core this process may use)"
# ... and those `diloco serve --resume DIR` may change (how long the server waits for workers)
SERVE_RESUME_OVERRIDES = (
    "threads",
    "round_timeout_s",
    "worker_timeout_s",
    "max_update_norm_ratio",
    "max_staleness",
)


def _flag_type(parse, flag: str):
    """An argparse type from a setting's parser: its ValueError becomes argparse's one-line error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e) or f"bad value for {flag}: {text!r}") from None

    return convert


def _add_setting_flags(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """--config, then one flag per config field that declares one (config.py), dest = the field's
    dotted path, in the help groups of config.FLAG_GROUPS (a section's group is titled by its
    docstring's first line). Returns the groups by name, for the command's other flags."""
    sections = settings.sections(TrainConfig)
    groups: dict[str, Any] = {}
    for name, title in FLAG_GROUPS.items():
        if not title:
            doc = (sections[name].__doc__ or "").split("\n")[0].rstrip(".")
            title = f"[{name}] {doc}"
        groups[name] = parser.add_argument_group(title)
    groups["run"].add_argument("--config", type=Path, help="TOML file of settings; flags override it")
    flagged = [s for s in settings.walk(TrainConfig) if s.flag]
    for s in flagged:
        if s.group not in groups:
            raise AssertionError(f"{s.path} has no group of config.FLAG_GROUPS; give it group=...")
    for s in sorted(flagged, key=lambda s: list(groups).index(s.group)):  # usage in the help's order
        kw: dict[str, Any] = {"dest": s.path, "default": None, "help": settings.help_text(s)}
        metavar = s.flag.lstrip("-").replace("-", "_").upper()
        if s.type is bool:  # on by default: --X and --no-X
            kw["action"] = argparse.BooleanOptionalAction if s.default else "store_true"
        elif s.meta.parse is not None:
            kw.update(type=_flag_type(s.meta.parse, s.flag), metavar=metavar)
        elif settings.is_list(s.type):  # one or more items, and repeatable: each use adds
            kw.update(action="extend", nargs="+", type=typing.get_args(s.type)[0], metavar=metavar)
        else:
            kw.update(type=s.type, metavar=metavar)
        groups[s.group].add_argument(s.flag, **kw)
    return groups


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-1e-3" for an option (its own pattern knows only "-1" and "-0.5"): a
        # negative number in any form Python reads is a value (--inner-lr -1e-3 gets its range check)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$")

    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        self.exit(2, f"diloco: error: {message}; see '{self.prog} --help'.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diloco", description="Low-communication training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser(
        "train", help="train with DiLoCo, asynchronous Local-SGD or a baseline (simulator or torchrun)"
    )
    output = _add_setting_flags(train)["output"]
    for action in train._actions:  # the server runtime is a command of its own
        if action.dest == "runtime":
            action.help = "where workers run (sim | collective; default: sim); a server: diloco serve"
    output.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue a run from its latest checkpoint, bit for bit; only "
        + ", ".join(settings.find(TrainConfig, p).flag for p in RESUME_OVERRIDES)
        + " may change (and --stop-after, --progress)",
    )
    output.add_argument(
        "--stop-after",
        type=int,
        metavar="ROUND",
        help="save a checkpoint after this round and stop (continue with --resume)",
    )
    output.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=PROGRESS,
    )
    serve = sub.add_parser(
        "serve", help="run a parameter server (sync or async) that workers join with diloco worker"
    )
    groups = _add_setting_flags(serve)
    for action in serve._actions:  # the server always checkpoints: its write-ahead log is cut there
        if action.dest == "checkpoint_every":
            action.help = "rounds between checkpoints, each of which cuts the write-ahead log (default: 1)"
    groups["output"].add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="restart a server run from its checkpoint and write-ahead log, on the host, port, TLS "
        "files and token it had (unless given); only "
        + ", ".join(settings.find(TrainConfig, p).flag for p in SERVE_RESUME_OVERRIDES)
        + " may change (and --progress); a finished run is left as it is",
    )
    groups["parameter_server"].add_argument(
        "--host",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for workers elsewhere; "
        "--resume: the run's)",
    )
    groups["parameter_server"].add_argument(
        "--port", type=int, help="port to listen on (default 7000; 0: any free port; --resume: the run's)"
    )
    groups["output"].add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="show a progress bar"
    )
    sec = serve.add_argument_group(
        "security and the status page (docs/server.md; --resume keeps the run's unless given)"
    )
    sec.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="the run's secret, which workers must send (default: $DILOCO_TOKEN, else one is "
        "generated into RUN_DIR/token)",
    )
    sec.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="let anyone who reaches the port in (loopback experiments only)",
    )
    sec.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve over TLS with this certificate")
    sec.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    sec.add_argument(
        "--http-port",
        type=int,
        metavar="PORT",
        help="port of the status page (default: --port + 1; 0: any free port; -1: no status page)",
    )
    worker = sub.add_parser("worker", help="work for a parameter server until its run is done")
    worker.add_argument("--server", required=True, metavar="HOST:PORT", help="the server's address")
    worker.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N) (default cpu)")
    worker.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (default 1: one per worker sharing a machine)",
    )
    worker.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        metavar="F",
        help="emulate a machine F times slower: every inner step is padded to F x its time (default 1)",
    )
    worker.add_argument(
        "--token-file", type=Path, metavar="FILE", help="the run's token (default: $DILOCO_TOKEN)"
    )
    worker.add_argument(
        "--tls-ca",
        type=Path,
        metavar="PEM",
        help="connect over TLS, trusting the certificates this CA signed",
    )
    worker.add_argument(
        "--acks",
        type=Path,
        metavar="FILE",
        help="append a JSON line per acknowledged push (job, seconds) to FILE: for load tests",
    )
    worker.add_argument(
        "--retry-s",
        type=float,
        default=60.0,
        help="seconds to keep retrying while the server cannot be reached (default 60)",
    )
    replay = sub.add_parser(
        "replay", help="re-run a server run's recorded schedule in one process; check θ bit for bit"
    )
    replay.add_argument("run", type=Path, metavar="RUN_DIR")
    replay.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help=PROGRESS)
    ev = sub.add_parser("eval", help="loss and perplexity of a finished run's model on any text")
    ev.add_argument("run", type=Path, metavar="RUN_DIR")
    ev.add_argument(
        "--data",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="text to evaluate on, in any form that diloco train --data reads "
        "(default: the run's validation split)",
    )
    ev.add_argument("--text-field", help="the text column of jsonl, json, parquet, csv (default: the run's)")
    ev.add_argument("--json", action="store_true", help="print one JSON object: val_loss, val_ppl, tokens")
    ev.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help=PROGRESS)
    ev.add_argument("--threads", type=int, default=0, help=USE_THREADS)
    gen = sub.add_parser("generate", help="sample text from a finished run's model")
    gen.add_argument("run", type=Path, metavar="RUN_DIR")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to add (default 200)")
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature; 0: always the most likely (default 0.8)",
    )
    gen.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all (default 0)"
    )
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    gen.add_argument("--threads", type=int, default=0, help=USE_THREADS)
    export = sub.add_parser(
        "export", help="write a finished run's model and tokenizer for Hugging Face transformers"
    )
    export.add_argument("run", type=Path, metavar="RUN_DIR")
    export.add_argument("out", type=Path, metavar="OUT_DIR", help="a new (or empty) folder")
    plot = sub.add_parser("plot", help="validation loss of several runs on one figure")
    plot.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    plot.add_argument(
        "--x",
        default="sim_time_s",
        choices=X_AXES,
        help=" | ".join(X_AXES) + " (default sim_time_s; local_steps: inner steps of all workers)",
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
    from diloco.cli.plots import plot_runs

    labels = args.labels.split(",") if args.labels else None
    print(plot_runs(args.runs, x=args.x, out=args.out, labels=labels, title=args.title, ymax=args.ymax))
    return 0


def _use(args: argparse.Namespace) -> int:
    """diloco eval, generate and export (use.py)."""
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
            print(f"val_loss {loss:.4f}   val_ppl {ppl:.3f}   tokens {tokens:,}")
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


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags: {dotted path: value}."""
    flagged = (s.path for s in settings.walk(TrainConfig) if s.flag)
    return {path: getattr(args, path) for path in flagged if getattr(args, path) is not None}


def _resumed_config(
    args: argparse.Namespace, overrides: dict[str, Any], allowed_paths: tuple[str, ...] = RESUME_OVERRIDES
) -> TrainConfig:
    from diloco.rundir import load_run_config

    saved = load_run_config(args.resume)

    def same(given: Any, kept: Any) -> bool:  # a flag's value and config.json's (lists: tuples)
        if isinstance(given, list | tuple) and isinstance(kept, list | tuple):
            return len(given) == len(kept) and all(map(same, given, kept))
        return str(given) == str(kept) if isinstance(given, Path) or isinstance(kept, Path) else given == kept

    overrides = {  # a flag that says what the run already has changes nothing
        p: v for p, v in overrides.items() if p in allowed_paths or not same(v, settings.get(saved, p))
    }
    refused = [
        f"{settings.find(TrainConfig, p).flag} {v} where the run has {settings.get(saved, p)}"
        for p, v in overrides.items()
        if p not in allowed_paths
    ]
    refused += ["--config"] if args.config is not None else []
    if refused:
        allowed = ", ".join(settings.find(TrainConfig, p).flag for p in allowed_paths)
        raise UserError(
            f"--resume continues a run with its saved config.json and allows only {allowed} besides; "
            f"drop the settings that change it ({'; '.join(refused)})."
        )
    values = saved.to_dict()
    runtime = overrides.get("runtime", saved.runtime)
    if runtime != saved.runtime:
        # Moving runtimes: the settings of the runtime the run leaves (its clock, its buckets and
        # timeout) never change a sync run's parameters, so they go back to their defaults.
        for s in settings.walk(TrainConfig):
            if s.meta.needs and s.meta.needs[0] == "runtime" and s.meta.needs[1] != runtime:
                values = merge(values, settings.nest(s.path, s.default))
    for path, value in overrides.items():
        values = merge(values, settings.nest(path, value))
    return from_dict(values, where=f"{args.resume / 'config.json'} with the flags")  # validated once


def _finished(run_dir: Path) -> bool:
    """A finished run (`rundir.finished`) is left as it is: --resume says so (rank 0 alone, under
    torchrun) and exits 0, with nothing left to do, rather than redo its final evaluation."""
    from diloco.rundir import finished

    if not finished(run_dir):
        return False
    if os.environ.get("RANK", "0") == "0":
        print(f"{run_dir} is a finished run (its summary.json says how it ended); nothing to resume.")
    return True


def _train(args: argparse.Namespace) -> int:
    from diloco.run.train import train

    overrides = _overrides(args)
    not_here = "the server runtime is started by diloco serve (see docs/server.md), not diloco train."
    if overrides.get("runtime") == "server":
        raise UserError(not_here)
    if args.resume is not None:
        cfg = _resumed_config(args, overrides)
        if cfg.runtime == "server":
            raise UserError(
                f"{args.resume} is a parameter server run; continue it with diloco serve --resume."
            )
        if _finished(args.resume):
            return 0
    else:
        values = load_toml(args.config) if args.config is not None else {}
        for path, value in overrides.items():
            values = merge(values, settings.nest(path, value))
        if values.get("runtime") == "server":
            raise UserError(not_here)
        if (
            values.get("runtime") == "collective"
            and "num_workers" not in values
            and "WORLD_SIZE" in os.environ
        ):
            # under torchrun the number of workers follows from the ranks started (a bad
            # procs_per_worker is left to the config's own check)
            m = values.get("procs_per_worker", 1)
            if isinstance(m, int) and not isinstance(m, bool) and m >= 1:
                values["num_workers"] = int(os.environ["WORLD_SIZE"]) // m
        cfg = from_dict(values, where=str(args.config) if args.config else "the flags")
    if args.stop_after is not None and not 1 <= args.stop_after < cfg.rounds:
        raise UserError(
            f"--stop-after must be a round from 1 to {cfg.rounds - 1} (the run has {cfg.rounds} rounds), "
            f"got {args.stop_after}; choose one of them or drop it."
        )
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


def _serve(args: argparse.Namespace) -> int:
    from diloco.run.train import train
    from diloco.runtime.server import security

    overrides = _overrides(args)
    if overrides.pop("runtime", "server") != "server":
        raise UserError("diloco serve is the server runtime; drop --runtime (or use diloco train).")
    if args.resume is not None:
        cfg = _resumed_config(args, overrides, SERVE_RESUME_OVERRIDES)
        if cfg.runtime != "server":
            raise UserError(f"{args.resume} is not a server run; continue it with diloco train --resume.")
        if _finished(args.resume):
            return 0
        from diloco.rundir import lock

        lock(args.resume, probe=True)  # a live server's directory: refused before the data is made
    else:
        values = load_toml(args.config) if args.config is not None else {}
        if values.pop("runtime", "server") != "server":
            raise UserError(f"{args.config} sets runtime; diloco serve is the server runtime: drop it.")
        values["runtime"] = "server"
        values.setdefault("checkpoint_every", 1)  # the write-ahead log is cut at every checkpoint
        for path, value in overrides.items():
            values = merge(values, settings.nest(path, value))
        cfg = from_dict(values, where=str(args.config) if args.config else "the flags")
    opts = _serve_options(args)
    security.explicit_token(opts)  # a bad or conflicting token is refused before anything is written
    terminate = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: as Ctrl-C
    try:
        summary = train(cfg, resume=args.resume, progress=args.progress, serve=opts)
    finally:
        signal.signal(signal.SIGTERM, terminate)
    _report(summary)
    return 0


def _serve_options(args: argparse.Namespace):
    """Where and how diloco serve faces the network: the flags given, else (--resume) what the run
    had (the "serve" record of RUN_DIR/server.json: host, port, status page, TLS files, where the
    token came from), else the defaults; so a plain --resume continues the same run."""
    from diloco.runtime.server import security
    from diloco.runtime.server.security import ServeOptions

    saved = _served(args.resume, args) if args.resume is not None else {}
    host = args.host if args.host is not None else saved.get("host", "127.0.0.1")
    port = args.port if args.port is not None else saved.get("port", 7000)
    http_port = args.http_port  # a server moved with --port takes its status page along (port + 1)
    if http_port is None and (args.port is None or saved.get("http_port") == -1):  # none stays none
        http_port = saved.get("http_port")
    tls_cert, tls_key = args.tls_cert, args.tls_key
    if tls_cert is None and tls_key is None and saved.get("tls_cert"):
        tls_cert, tls_key = Path(saved["tls_cert"]), Path(saved["tls_key"])
    token_file, no_token = args.token_file, args.insecure_no_token
    if token_file is None and not no_token:
        kind = saved.get("token")
        if kind == "file":
            token_file = Path(saved["token_file"])
        elif kind == "generated" and (args.resume / "token").is_file():  # deleted: a new one is made
            token_file = args.resume / "token"
        elif kind == "none":
            no_token = True
        elif kind == "env" and not os.environ.get(security.ENV):
            raise UserError(
                f"the run's token came from ${security.ENV}, which is not set; set it as when the run "
                "started (or give --token-file FILE for a new token)."
            )
    recorded = f"recorded in {args.resume / 'server.json'} as this run's" if args.resume else ""
    for path, flag, given in (
        (token_file, "--token-file", args.token_file),
        (tls_cert, "--tls-cert", args.tls_cert),
        (tls_key, "--tls-key", args.tls_key),
    ):
        if path is not None and given is None and not path.is_file():
            raise UserError(f"{path}, {recorded} {flag}, is not a file; put it back or give {flag} FILE.")
    if not 0 <= port < 65536:
        raise UserError(f"--port must be from 0 to 65535, got {port}.")
    if http_port is not None and not -1 <= http_port < 65536:
        raise UserError(f"--http-port must be from 0 to 65535, or -1 for no status page; got {http_port}.")
    if (tls_cert is None) != (tls_key is None):
        raise UserError("--tls-cert and --tls-key go together: give both (or neither, for no TLS).")
    for path in (args.token_file, args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            raise UserError(f"{path} is not a file; give the path of an existing file.")
    return ServeOptions(
        listen=f"{host}:{port}",
        token_file=token_file,
        insecure_no_token=no_token,
        tls_cert=tls_cert,
        tls_key=tls_key,
        http_port=http_port,
    )


def _served(run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """How the run at `run_dir` last served: server.json's "serve" record; for a server.json of a
    diloco before issue 29 (no record), its address, and a refusal where it served TLS or kept a
    token that nothing here can name; {} for a run that never served (no worker knows it yet)."""
    import json

    try:
        info = json.loads((run_dir / "server.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(info, dict) or isinstance(info.get("serve"), dict):
        return info.get("serve", {}) if isinstance(info, dict) else {}
    host, _, port = str(info.get("address", "")).rpartition(":")
    saved: dict[str, Any] = {"host": host, "port": int(port)} if host and port.isdigit() else {}
    if info.get("tls") and args.tls_cert is None:
        raise UserError(
            f"{run_dir} served TLS, and its server.json (from an older diloco) does not say with which "
            "files; give --tls-cert and --tls-key as when it started."
        )
    return saved


def _worker(args: argparse.Namespace) -> int:
    from diloco.run.worker import run_worker
    from diloco.runtime.server import security

    if args.threads < 1 or not args.slowdown >= 1.0 or not args.retry_s >= 0:
        raise UserError(
            f"diloco worker needs --threads >= 1, --slowdown >= 1 and --retry-s >= 0, got {args.threads}, "
            f"{args.slowdown} and {args.retry_s}."
        )
    for path in (args.token_file, args.tls_ca):
        if path is not None and not path.is_file():
            raise UserError(f"{path} is not a file; give the path of an existing file.")
    return run_worker(
        args.server,
        device=args.device,
        threads=args.threads,
        slowdown=args.slowdown,
        retry_s=args.retry_s,
        token=security.given_token(args.token_file),
        tls_ca=args.tls_ca,
        acks=args.acks,
    )


def _replay(args: argparse.Namespace) -> int:
    from diloco.run.replay import replay
    from diloco.rundir.metrics import to_json

    result = replay(args.run, progress=args.progress)
    print(to_json(result, indent=2))
    if result["bitwise_equal"]:
        print(f"replay of {args.run}: the final parameters are equal bit for bit ({result['events']} events)")
        return 0
    print(f"replay of {args.run}: the final parameters differ (max |diff| {result['max_abs_diff']:.3g})")
    return 1


def _report(summary: dict) -> None:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # gRPC's own log lines (an info line per failed TLS handshake, an error line for a port in
    # use) would repeat what diloco says in one sentence; GRPC_VERBOSITY=ERROR (or INFO, DEBUG) in
    # the environment brings them back
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "worker":
            return _worker(args)
        if args.command == "replay":
            return _replay(args)
        if args.command in ("eval", "generate", "export"):
            return _use(args)
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
