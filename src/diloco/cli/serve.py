"""The parameter server's verbs: diloco serve (a run on the server runtime, and how it faces the
network), diloco worker (one worker joining it) and diloco replay (its run again, in one process).

    from diloco.cli.serve import serve_command
    cfg, summary = serve_command(build_parser().parse_args(["serve", "--workers", "2"]))
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

from diloco.cli.configure import SERVE_RESUME_OVERRIDES, finished, given_settings, resumed_run, with_flags
from diloco.config import TrainConfig, load_toml
from diloco.config.parsers import parse_worker_slowdown
from diloco.errors import UserError


def serve_command(args: argparse.Namespace) -> tuple[TrainConfig, dict] | None:
    """Run `diloco serve`: its config and summary, or None where --resume finds the run finished."""
    from diloco.run.train import train
    from diloco.rundir import lock
    from diloco.runtime.server import security

    flags = given_settings(args)
    if flags.pop("runtime", "server") != "server":
        raise UserError("diloco serve is the server runtime; drop --runtime (or use diloco train).")
    if args.resume is not None:
        cfg = resumed_run(args.resume, flags, SERVE_RESUME_OVERRIDES, config_file=args.config)
        if cfg.runtime != "server":
            raise UserError(f"{args.resume} is not a server run; continue it with diloco train --resume.")
        if finished(args.resume):
            return None
        lock(args.resume, probe=True)  # a live server's directory: refused before the data is made
    else:
        values = load_toml(args.config) if args.config is not None else {}
        if values.pop("runtime", "server") != "server":
            raise UserError(f"{args.config} sets runtime; diloco serve is the server runtime: drop it.")
        values["runtime"] = "server"
        values.setdefault("checkpoint_every", 1)  # the write-ahead log is cut at every checkpoint
        cfg = with_flags(values, flags, where=str(args.config) if args.config else "the flags")
    opts = serve_options(args)
    security.explicit_token(opts)  # a bad or conflicting token is refused before anything is written
    terminate = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: as Ctrl-C
    try:
        summary = train(cfg, resume=args.resume, progress=args.progress, serve=opts)
    finally:
        signal.signal(signal.SIGTERM, terminate)
    return cfg, summary


def serve_options(args: argparse.Namespace):
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


def worker_command(args: argparse.Namespace) -> int:
    """Run `diloco worker`: its exit status."""
    from diloco.run.worker import run_worker
    from diloco.runtime.server import security

    try:
        slowdown = parse_worker_slowdown(args.slowdown)
    except ValueError:
        raise UserError(
            f"--slowdown must be F or F@START-END (F >= 1, 0 <= START < END seconds, END may be inf), "
            f"got {args.slowdown!r}; e.g. --slowdown 2 or --slowdown 3@60-inf."
        ) from None
    if args.threads < 1 or not args.retry_s >= 0 or not 0 <= args.step_s < 3600:
        raise UserError(
            f"diloco worker needs --threads >= 1, --retry-s >= 0 and --step-s in [0, 3600), "
            f"got {args.threads}, {args.retry_s} and {args.step_s}."
        )
    for path in (args.token_file, args.tls_ca):
        if path is not None and not path.is_file():
            raise UserError(f"{path} is not a file; give the path of an existing file.")
    return run_worker(
        args.server,
        device=args.device,
        threads=args.threads,
        slowdown=slowdown,
        step_s=args.step_s,
        retry_s=args.retry_s,
        token=security.given_token(args.token_file),
        tls_ca=args.tls_ca,
        acks=args.acks,
    )


def replay_command(args: argparse.Namespace) -> int:
    """Run `diloco replay`: 0 where the replayed parameters equal the run's bit for bit, else 1."""
    from diloco.run.replay import replay
    from diloco.rundir.metrics import to_json

    result = replay(args.run, progress=args.progress)
    print(to_json(result, indent=2))
    if result["bitwise_equal"]:
        print(f"replay of {args.run}: the final parameters are equal bit for bit ({result['events']} events)")
        return 0
    print(f"replay of {args.run}: the final parameters differ (max |diff| {result['max_abs_diff']:.3g})")
    return 1
