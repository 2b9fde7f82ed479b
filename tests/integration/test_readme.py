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
