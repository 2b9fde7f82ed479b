"""A server's life for real: started hardened (TLS, a token file, every interface), a second
server refused on its live run directory, stopped with SIGTERM, resumed as its printed hint says,
finished, and resumed once more (nothing to do); a start on a taken port that leaves nothing."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_server import TOKEN, finish, free_port, serve, wait_for, worker
from test_server_hostile import Client, _serving
from test_server_security import NO_TOKEN_ENV, make_certificates

from diloco.cli.main import main
from diloco.runtime.server import service

RUN = ["--method", "async", "--workers", "1", "--inner-steps", "4", "--rounds", "2"]


def files(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of the run directory: its bytes and modification time."""
    return {
        str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def served(run_dir: Path, pid: int) -> dict:
    """server.json, once the server with this pid has written it."""
    path = run_dir / "server.json"
    wait_for(lambda: path.exists() and json.loads(path.read_text())["pid"] == pid, what="server.json")
    return json.loads(path.read_text())


@pytest.mark.slow  # the suite's 10 minutes: test_server.py resumes a server killed with -9
@pytest.mark.timeout(240)
def test_a_hardened_server_stopped_with_sigterm_resumes_as_its_hint_says(tmp_path, capsys):
    tls = make_certificates(tmp_path / "tls", "IP:127.0.0.1")  # docs/server.md's recipe
    cert, key, ca = tls / "server.pem", tls / "server.key", tls / "ca.pem"
    (tmp_path / "token.txt").write_text(TOKEN + "\n")
    port, run_dir = free_port(), tmp_path / "run"
    hardened = ["--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(tmp_path / "token.txt")]
    srv = serve(tmp_path, *RUN, "--host", "0.0.0.0", *hardened, port=port, env=NO_TOKEN_ENV)
    served(run_dir, srv.pid)

    # a second server on the live run directory: one sentence naming the live one, nothing written
    before = files(run_dir)
    second = serve(tmp_path, "--resume", str(run_dir), port=free_port(), env=NO_TOKEN_ENV)
    ((rc, err),) = finish(second)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"is in use by a live server (pid {srv.pid}, serving on 0.0.0.0:{port})" in err, err
    assert files(run_dir) == before

    # SIGTERM: as Ctrl-C, with the hint
    srv.send_signal(signal.SIGTERM)
    ((rc, err),) = finish(srv)
    assert rc == 130, err
    # every interface: the printed worker command and status page name addresses others can use
    command = re.search(r"start workers with: (diloco worker .*)", err).group(1)
    page = re.search(r"status page: (\S+)", err).group(1)
    assert "0.0.0.0" not in command and "0.0.0.0" not in page, err
    assert "--tls-ca CA.pem --token-file TOKEN_FILE" in command and page.startswith("https://")
    assert socket.gethostname() in command, command
    hint = re.search(r"continue with: (diloco serve --resume \S+)$", err, re.MULTILINE).group(1)

    # resume flags: those that say what the run has pass, a change is refused naming both values
    assert main(["serve", "--resume", str(run_dir), "--workers", "2"]) == 2
    assert "--workers 2 where the run has 1" in capsys.readouterr().err

    # the hint as printed (no token, TLS or port given), with a flag equal to the run's: the same
    # run on the same port, TLS and token, which the worker's CA and token file still reach
    cmd = [sys.executable, "-m", *hint.split(), "--workers", "1"]
    again = subprocess.Popen(cmd, env=NO_TOKEN_ENV, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert served(run_dir, again.pid)["address"] == f"0.0.0.0:{port}"
    joined = ["--tls-ca", str(ca), "--token-file", str(tmp_path / "token.txt")]
    results = finish(again, worker(f"127.0.0.1:{port}", *joined, env=NO_TOKEN_ENV))
    assert [rc for rc, _ in results] == [0, 0], results
    assert not (run_dir / "token").exists()  # the token is still the file's, none was generated

    # a finished run: said so, exit 0, nothing changed
    before = files(run_dir)
    time.sleep(0.01)
    assert main(["serve", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "is a finished run" in out, out
    assert files(run_dir) == before

    # replay of a log two servers wrote to: one sentence, exit 2
    lines = (run_dir / "events.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "events.jsonl").write_text("".join(lines[:3] + lines[1:]))
    assert main(["replay", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "events.jsonl is damaged at line 4" in err, err


@pytest.mark.timeout(120)
def test_a_start_on_a_taken_port_leaves_no_run_directory_and_a_retry_works(tmp_path):
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ((rc, err),) = finish(serve(tmp_path, *RUN, port=taken.getsockname()[1]))
    assert rc == 2 and "cannot listen on 127.0.0.1:" in err, err
    assert "add_port" not in err and "Traceback" not in err, err  # gRPC's own line is off
    assert not run_dir.exists()
    srv = serve(tmp_path, *RUN)  # the same --out
    served(run_dir, srv.pid)
    srv.send_signal(signal.SIGINT)
    ((rc, err),) = finish(srv)
    assert rc == 130 and f"continue with: diloco serve --resume {run_dir}" in err, err


@pytest.fixture
def idle_server(tmp_path, monkeypatch):
    monkeypatch.setattr(service, "NOTE_S", 0.2)
    yield from _serving(tmp_path)


@pytest.mark.timeout(60)
def test_a_worker_that_leaves_is_logged_and_waiting_is_said_at_growing_intervals(idle_server, capsys):
    client = Client(idle_server.address).register()
    client.stub.Leave(client.ref, timeout=10, metadata=client.meta)
    wait_for(lambda: "worker 0 (hand) left the run" in capsys.readouterr().err, 10, "the leave's line")
    time.sleep(2.6)  # notes due 0.2, 0.6, 1.4 and 3.0 s after a wait began (every 0.2 s: 13)
    notes = capsys.readouterr().err.count("no worker registered")
    assert 1 <= notes <= 4, notes
