"""The `diloco` command's parser: a flag per setting for `train` and `serve`, generated from the
settings table (config/), beside each verb's hand-written flags (one function per verb below).

    from diloco.cli.parser import build_parser
    args = build_parser().parse_args(["train", "--workers", "8"])
"""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path
from typing import Any

from diloco import settings
from diloco.cli.configure import RESUME_OVERRIDES, SERVE_RESUME_OVERRIDES
from diloco.cli.plots import X_AXES
from diloco.config import FLAG_GROUPS, TrainConfig

PROGRESS = "show a progress bar (default: when stderr is a terminal)"
USE_THREADS = "intra-op threads (default 0: every core this process may use)"


def _flag_type(parse, flag: str):
    """An argparse type from a setting's parser: its ValueError becomes argparse's one-line error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e) or f"bad value for {flag}: {text!r}") from None

    return convert


def _add_setting_flags(parser: argparse.ArgumentParser, helps: dict[str, str]) -> dict[str, Any]:
    """--config, then one flag per config field that declares one (config/), dest = the field's
    dotted path, in the help groups of config.FLAG_GROUPS (a section's group is titled by its
    docstring's first line); `helps` replaces the help of the settings it names, for this command.
    Returns the groups by name, for the command's other flags."""
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
        text = helps.get(s.path, settings.help_text(s))
        kw: dict[str, Any] = {"dest": s.path, "default": None, "help": text}
        metavar = s.flag.lstrip("-").replace("-", "_").upper()
        if settings.is_switch(s.type):  # on (or unset) by default: --X and --no-X
            kw["action"] = argparse.BooleanOptionalAction if s.default is not False else "store_true"
        elif s.meta.parse is not None:
            kw.update(type=_flag_type(s.meta.parse, s.flag), metavar=metavar)
        elif settings.is_list(s.type):  # one or more items, and repeatable: each use adds
            kw.update(action="extend", nargs="+", type=typing.get_args(s.type)[0], metavar=metavar)
        else:
            kw.update(type=s.type, metavar=metavar)
        groups[s.group].add_argument(s.flag, **kw)
    return groups


def _address(text: str) -> str:
    """A server's HOST:PORT (argparse type): a host and a port from 1 to 65535."""
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port from 1 to 65535")
    return text


def _flags(paths: tuple[str, ...]) -> str:
    return ", ".join(settings.find(TrainConfig, p).flag for p in paths)


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
    for add in (
        _train,
        _plan,
        _serve,
        _worker,
        _replay,
        _eval,
        _generate,
        _export,
        _plot,
    ):  # the help's order
        add(sub)
    return parser


def _train(sub: Any) -> None:
    train = sub.add_parser(
        "train", help="train with DiLoCo, asynchronous Local-SGD or a baseline (simulator or torchrun)"
    )
    # the server runtime is a command of its own
    runtime = "where workers run (sim | collective; default: sim); a server: diloco serve"
    output = _add_setting_flags(train, {"runtime": runtime})["output"]
    output.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue a run from its latest checkpoint, bit for bit; only "
        + _flags(RESUME_OVERRIDES)
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


def _plan(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="predict a run's wall time, compute utilisation and bytes without training (docs/planning.md)",
    )
    _add_setting_flags(
        plan,
        {
            "sim.speeds": "seconds per inner step of each worker (as --step-s)",
            "runtime": "server (default): workers pull θ and push over their own links (a star), an async "
            "worker's first job its probe alone; sim: the simulator's own run (it folds the probe into "
            "the first job); collective: torchrun's ring all-reduce",
        },
    )
    machines = plan.add_argument_group("the machines (diloco plan)")
    machines.add_argument(
        "--step-s",
        metavar="S[,S,...]",
        help="seconds per inner step of each worker (one value: every worker); or --probe",
    )
    machines.add_argument(
        "--probe", action="store_true", help="time a few inner steps of the model on this machine instead"
    )
    machines.add_argument(
        "--probe-link",
        type=_address,
        metavar="HOST:PORT",
        help="measure the link to a running diloco serve (latency, Mbit/s down and up; the slower "
        "direction is every worker's link), with --token-file (or $DILOCO_TOKEN) and --tls-ca",
    )
    machines.add_argument("--token-file", type=Path, metavar="FILE", help="the run's token, for --probe-link")
    machines.add_argument(
        "--tls-ca", type=Path, metavar="PEM", help="the CA to trust, for --probe-link over TLS"
    )
    machines.add_argument(
        "--link-mbps",
        metavar="MBPS[,MBPS,...]",
        help="each worker's link in Mbit/s (one value: every worker's; default --bandwidth-mbps; "
        "0: unlimited)",
    )
    machines.add_argument(
        "--sweep",
        action="append",
        metavar="KEY=V1,V2,...",
        help="plan every combination: a setting's flag name (inner-steps, codec, fragments, workers, "
        "...) or H, with its values; repeatable",
    )
    machines.add_argument(
        "--rounds-simulated",
        type=int,
        default=50,
        metavar="N",
        help="rounds simulated; a longer run is scaled up from them (default 50)",
    )
    machines.add_argument("--json", action="store_true", help="print JSON (a list with --sweep)")


def _serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", help="run a parameter server (sync or async) that workers join with diloco worker"
    )
    # the server always checkpoints: its write-ahead log is cut there
    every = "rounds between checkpoints, each of which cuts the write-ahead log (default: 1)"
    groups = _add_setting_flags(serve, {"checkpoint_every": every})
    groups["output"].add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="restart a server run from its checkpoint and write-ahead log, on the host, port, TLS "
        "files and token it had (unless given); only "
        + _flags(SERVE_RESUME_OVERRIDES)
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


def _worker(sub: Any) -> None:
    worker = sub.add_parser("worker", help="work for a parameter server until its run is done")
    worker.add_argument(
        "--server", required=True, type=_address, metavar="HOST:PORT", help="the server's address"
    )
    worker.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N) (default cpu)")
    worker.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (default 1: one per worker sharing a machine)",
    )
    worker.add_argument(
        "--slowdown",
        default="1",
        metavar="F[@START-END]",
        help="emulate a machine F times slower: every inner step is padded to F x its time (default "
        "1); with @START-END only from START to END seconds after its first inner step (END: inf)",
    )
    worker.add_argument(
        "--step-s",
        type=float,
        default=0.0,
        metavar="S",
        help="emulate a device of S seconds per inner step: each step padded to at least S, then "
        "times --slowdown (default 0: as fast as this machine)",
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


def _replay(sub: Any) -> None:
    replay = sub.add_parser(
        "replay", help="re-run a server run's recorded schedule in one process; check θ bit for bit"
    )
    replay.add_argument("run", type=Path, metavar="RUN_DIR")
    replay.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help=PROGRESS)


def _eval(sub: Any) -> None:
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


def _generate(sub: Any) -> None:
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


def _export(sub: Any) -> None:
    export = sub.add_parser(
        "export", help="write a finished run's model and tokenizer for Hugging Face transformers"
    )
    export.add_argument("run", type=Path, metavar="RUN_DIR")
    export.add_argument("out", type=Path, metavar="OUT_DIR", help="a new (or empty) folder")


def _plot(sub: Any) -> None:
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
