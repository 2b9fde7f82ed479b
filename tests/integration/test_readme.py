"""README's library example runs as written and trains."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _library_example() -> str:
    section = README.read_text().split("## Use it as a library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(60)
def test_library_example_runs_and_learns(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_library_example())
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"max weight error ([\d.]+) after 50 outer updates; ([\d,]+) bytes", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(1)) < 0.01
    assert int(match.group(2).replace(",", "")) == 50 * 8 * 4  # 50 rounds of 8 fp32 values


def test_readme_opens_with_the_two_commands_ci_runs():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    assert [line.split()[0:2] for line in first_block.splitlines()] == [["make", "run"], ["make", "test"]]
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def _server_example() -> str:
    """README's block that starts a parameter server and four workers, then replays the run."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if "diloco serve" in b)
    return block


@pytest.mark.slow  # the default job on a server: a few minutes on 2 cores
@pytest.mark.timeout(900)
def test_readme_server_example_runs_as_pasted_even_with_a_token_already_exported(tmp_path):
    """Pasted into a shell as one block: the token is read only once serve has written it (it
    used to be read at once, before the file existed), and a DILOCO_TOKEN left in the
    environment by an earlier run is unset first (serve would take it and write no file); the
    workers finish the run and replay recomputes it bit for bit."""
    import os

    block = _server_example()
    assert "unset DILOCO_TOKEN" in block and "until [ -s runs/srv/token ]" in block
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": venv_bin + os.pathsep + os.environ["PATH"],
        "DILOCO_TOKEN": "an-old-run-token-0123456789",
    }
    proc = subprocess.run(
        ["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=880
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "runs" / "srv" / "summary.json").is_file()
    assert "bit for bit" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
