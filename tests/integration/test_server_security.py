"""The server in the open, for real: `diloco serve` and `diloco worker` processes with the run's
token (generated, from a file, wrong, missing), TLS with a certificate made here, and the
status page's HTTP endpoints behind the same token."""

from __future__ import annotations

import json
import re
import shutil
import ssl
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_server import ENV, address, events, finish, free_port, serve, wait_for, worker

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
NO_TOKEN_ENV = {k: v for k, v in ENV.items() if k != "DILOCO_TOKEN"}
RUN = ["--workers", "1", "--inner-steps", "4", "--rounds", "2"]


def get(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_url(run_dir: Path) -> str:
    address(run_dir)
    return json.loads((run_dir / "server.json").read_text())["http"]


@pytest.mark.timeout(120)
def test_a_generated_token_keeps_out_workers_without_it(tmp_path):
    """No --token-file and no DILOCO_TOKEN: the server writes RUN_DIR/token (0600). Workers with
    a wrong or no token exit 2 with one sentence and change nothing; with the file they work."""
    run_dir = tmp_path / "run"
    port = free_port()
    srv = serve(tmp_path, *RUN, port=port, env=NO_TOKEN_ENV, http_port=None)  # the default: +1
    addr = address(run_dir)
    token_path = run_dir / "token"
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    token = token_path.read_text().strip()
    assert len(token) >= 32

    (tmp_path / "wrong").write_text("w" * 40)
    intruders = [
        worker(addr, "--retry-s", "5", env=NO_TOKEN_ENV),
        worker(addr, "--retry-s", "5", "--token-file", str(tmp_path / "wrong"), env=NO_TOKEN_ENV),
    ]
    (rc1, err1), (rc2, err2) = finish(*intruders, timeout=60)
    assert (rc1, rc2) == (2, 2), (err1, err2)
    assert "sent no token; pass the run's token with --token-file" in err1
    assert "sent a token that is not the run's" in err2
    assert err1.count("\n") == 1 and err2.count("\n") == 1, (err1, err2)  # one sentence, no traceback
    assert not [e for e in events(run_dir) if e["kind"] == "join"]

    url = http_url(run_dir)
    assert url == f"http://127.0.0.1:{port + 1}"  # the default: --port + 1
    for path in ("/", "/status", "/metrics"):
        assert get(url + path)[0] == 401
        assert get(url + path, "w" * 40)[0] == 401
        assert get(f"{url}{path}?token={token}")[0] == 200
    status = json.loads(get(url + "/status", token)[1])
    assert status["version"] == 0 and status["workers"] == [] and status["unauthenticated"] >= 8

    ca = make_certificates(tmp_path / "tls", "IP:127.0.0.1") / "ca.pem"
    t0 = time.time()
    rc, err = finish(worker(addr, "--tls-ca", str(ca), env=NO_TOKEN_ENV))[0]
    assert rc == 2 and "does not speak TLS; drop --tls-ca" in err, err
    assert time.time() - t0 < 30  # at once, not after --retry-s 60
    good = worker(addr, "--token-file", str(token_path), env=NO_TOKEN_ENV)
    (rc_srv, err_srv), (rc_w, err_w) = finish(srv, good)
    assert (rc_srv, rc_w) == (0, 0), (err_srv, err_w)
    assert f"the workers' token is in {token_path}" in err_srv
    assert f"status page: {url}/?token={token}" in err_srv
    assert "refused a call without a token from 127.0.0.1:" in err_srv
    assert "refused a call with a wrong token from 127.0.0.1:" in err_srv
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outer_updates"] == 2


@pytest.mark.timeout(120)
def test_status_and_metrics_follow_the_run(tmp_path):
    run_dir = tmp_path / "run"
    srv = serve(tmp_path, "--method", "async", "--workers", "2", "--inner-steps", "4", "--rounds", "3")
    url, token = http_url(run_dir), ENV["DILOCO_TOKEN"]
    workers = [worker(address(run_dir), "--slowdown", "3") for _ in range(2)]
    wait_for(lambda: json.loads(get(url + "/status", token)[1])["version"] >= 2, what="two updates")
    status = json.loads(get(url + "/status", token)[1])
    assert status["method"] == "async" and status["inner_step_budget"] == 24
    assert 0 < status["inner_steps"] <= 24
    assert sorted(w["worker"] for w in status["workers"]) == [0, 1]
    keys = ("host", "device", "state", "step_s", "steps", "staleness", "jobs", "bytes_sent", "last_seen_s")
    for row in status["workers"]:
        assert all(key in row for key in keys) and "bytes_received" in row, row
        assert row["device"] == "cpu", row
    # two updates have been pushed, maybe both by one worker (the other slow to start on a busy machine)
    assert max(w["jobs"] for w in status["workers"]) >= 1, status["workers"]
    # two updates are two pushes; a first job's θ may not have crossed the wire (WorkerRef.theta)
    assert sum(w["bytes_sent"] for w in status["workers"]) > 0
    text = get(url + "/metrics", token)[1].decode()
    assert f"diloco_version {float(status['version'])}" in text or "diloco_version " in text
    assert 'diloco_worker_jobs_total{worker="0"}' in text and "diloco_inner_step_budget 24.0" in text
    results = finish(srv, *workers)
    assert [rc for rc, _ in results] == [0, 0, 0], results


def docs_block(heading: str) -> str:
    """The first bash block after `heading` in docs/server.md."""
    return re.search(r"```bash\n(.*?)```", DOCS.read_text().split(heading, 1)[1], re.S).group(1)


def make_certificates(directory: Path, san: str) -> Path:
    """A CA (ca.pem) and the server's certificate for `san` (server.pem, server.key) in
    `directory`, made by docs/server.md's commands (its SAN line set to `san`)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: the certificates are made with docs/server.md's commands")
    recipe = re.sub(r"^SAN=.*$", f'SAN="{san}"', docs_block("### Certificates"), count=1, flags=re.M)
    directory.mkdir(parents=True)
    done = subprocess.run(["bash", "-ec", recipe], cwd=directory, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return directory


@pytest.mark.timeout(60)
def test_a_bad_certificate_or_a_key_of_another_is_named_before_the_port(tmp_path, capsys):
    """gRPC refuses a bad pair only when binding, which read as a busy port: the pair is checked
    first, with one sentence naming both files (exit 2, no run directory)."""
    from diloco.cli.main import main

    one, two = (
        make_certificates(tmp_path / "one", "DNS:localhost"),
        make_certificates(tmp_path / "two", "DNS:x"),
    )
    (tmp_path / "garbage.pem").write_text("not a pem\n")
    garbage = str(tmp_path / "garbage.pem")
    for cert, key in [(garbage, garbage), (str(one / "server.pem"), str(two / "server.key"))]:
        out = tmp_path / "run"
        args = ["serve", *RUN, "--insecure-no-token", "--port", "0", "--tls-cert", cert, "--tls-key", key]
        assert main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its private key" in err
        assert "cannot listen" not in err and err.count("\n") == 1 and not out.exists()


@pytest.mark.timeout(120)
def test_tls_workers_trust_the_servers_certificate_and_refuse_another(tmp_path):
    """The server's certificate is for the host name localhost (docs/server.md's recipe). A worker
    that dials localhost with the CA works; told at once with one sentence (exit 2, not after
    --retry-s 60): a worker with another CA, one that dials 127.0.0.1 (an address the certificate
    does not list), one without --tls-ca."""
    tls = make_certificates(tmp_path / "tls", "DNS:localhost")
    other = make_certificates(tmp_path / "other", "DNS:localhost") / "ca.pem"
    run_dir = tmp_path / "run"
    srv = serve(tmp_path, *RUN, "--tls-cert", str(tls / "server.pem"), "--tls-key", str(tls / "server.key"))
    port = address(run_dir).rsplit(":", 1)[1]
    assert json.loads((run_dir / "server.json").read_text())["tls"] is True

    t0 = time.time()
    refused = [
        worker(f"localhost:{port}", "--tls-ca", str(other)),
        worker(f"127.0.0.1:{port}", "--tls-ca", str(tls / "ca.pem")),
        worker(f"localhost:{port}"),  # plaintext to a TLS server
    ]
    (rc1, err1), (rc2, err2), (rc3, err3) = finish(*refused, timeout=45)
    assert time.time() - t0 < 30, (err1, err2, err3)  # at once: the retries would take 60 s
    assert (rc1, rc2, rc3) == (2, 2, 2), (err1, err2, err3)
    assert all(e.count("\n") == 1 for e in (err1, err2, err3)), (err1, err2, err3)  # one sentence
    assert "the TLS handshake with" in err1 and f"--tls-ca {other}" in err1, err1
    assert (
        f"the certificate of the server at 127.0.0.1:{port} is for DNS localhost, not for 127.0.0.1" in err2
    )
    assert f"the server at localhost:{port} serves TLS; pass --tls-ca" in err3

    url = http_url(run_dir).replace("127.0.0.1", "localhost")
    assert url.startswith("https://")
    context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    assert get(url + "/status", ENV["DILOCO_TOKEN"], context)[0] == 200
    with pytest.raises(urllib.error.URLError):
        get(url + "/status", ENV["DILOCO_TOKEN"], ssl.create_default_context(cafile=str(other)))

    good = worker(f"localhost:{port}", "--tls-ca", str(tls / "ca.pem"))
    results = finish(srv, good)
    assert [rc for rc, _ in results] == [0, 0], results


@pytest.mark.timeout(60)
def test_insecure_no_token_warns_and_lets_workers_in(tmp_path):
    srv = serve(tmp_path, *RUN, "--insecure-no-token", env=NO_TOKEN_ENV)
    good = worker(address(tmp_path / "run"), env=NO_TOKEN_ENV)
    (rc_srv, err_srv), (rc_w, _) = finish(srv, good)
    assert (rc_srv, rc_w) == (0, 0), err_srv
    assert "WARNING: --insecure-no-token" in err_srv
    assert not (tmp_path / "run" / "token").exists()


def test_a_bad_token_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    from diloco.cli.main import main

    out = ["serve", "--out", str(tmp_path / "r")]
    (tmp_path / "short").write_text("abc\n")
    assert main([*out, "--token-file", str(tmp_path / "short")]) == 2
    assert "must be at least 16 printable characters" in capsys.readouterr().err
    monkeypatch.setenv("DILOCO_TOKEN", "abc")
    assert main(out) == 2
    assert "the token in $DILOCO_TOKEN must be at least 16" in capsys.readouterr().err
    monkeypatch.setenv("DILOCO_TOKEN", "a-long-enough-token-0123")
    assert main([*out, "--insecure-no-token"]) == 2
    assert "--insecure-no-token with --token-file or DILOCO_TOKEN: choose one" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(120)
def test_stale_pushes_are_refused_counted_and_replayed(tmp_path):
    """A worker 6x slower than the other, with --max-staleness 2 and DyLU off: most of its
    pushes come more than 2 updates late and are refused as stale (a `rejected` metrics line
    each; its job is given back), and it goes on with its next job, or stops with one sentence
    after 3 refusals in a row. The run ends and replays bit for bit, refused jobs included."""
    run_dir = tmp_path / "run"
    run = ["--method", "async", "--workers", "2", "--inner-steps", "4", "--rounds", "16"]
    srv = serve(tmp_path, *run, "--no-dylu", "--grace-s", "0", "--max-staleness", "2")
    # 16 rounds: under load one worker starts seconds after the other, and the slow one must still
    # push while the fast one is running (with 8 the run once ended after its first, fresh, push)
    fast, slow = worker(address(run_dir)), worker(address(run_dir), "--slowdown", "6")
    (rc_srv, err_srv), (rc_fast, _), (rc_slow, err_slow) = finish(srv, fast, slow)
    assert (rc_srv, rc_fast) == (0, 0) and rc_slow in (0, 2), (err_srv, err_slow)
    assert "stale: job" in err_slow and "Going on with the next job" in err_slow
    if rc_slow == 2:
        assert "3 updates of this worker were refused in a row" in err_slow
    rejects = [e for e in events(run_dir) if e["kind"] == "reject"]
    assert rejects and {e["reason"] for e in rejects} == {"stale"} and all(e["abandon"] for e in rejects)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["job"] for x in lines if x["kind"] == "rejected"] == [e["job"] for e in rejects]

    from diloco.run.replay import replay

    assert replay(run_dir)["bitwise_equal"]
