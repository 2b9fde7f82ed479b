"""docs/architecture.md's worked examples are real diffs of this tree: each still applies, and
adding a setting or a codec touches only its declaration, its component, tests and docs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"


def _diffs() -> list[str]:
    return re.findall(r"```diff\n(.*?)```", PAGE.read_text(), re.S)


def _files(diff: str) -> set[str]:
    return {line[len("+++ b/") :] for line in diff.splitlines() if line.startswith("+++ b/")}


@pytest.mark.timeout(30)
def test_a_setting_and_a_codec_touch_their_declaration_component_tests_and_docs_only():
    setting, codec = _diffs()
    source = {f for f in _files(setting) if f.startswith("src/")}
    assert source == {"src/diloco/config/sections.py", "src/diloco/core/outer.py"}
    assert {f for f in _files(codec) if f.startswith("src/")} == {"src/diloco/core/codec.py"}
    for diff in (setting, codec):
        assert all(f.startswith(("src/", "tests/", "docs/")) for f in _files(diff))
        assert any(f.startswith("tests/") for f in _files(diff)), "an example without its test"


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    not (ROOT / ".git").exists() or shutil.which("git") is None, reason="needs a git checkout"
)
def test_the_worked_examples_apply_to_this_tree(tmp_path):
    for i, diff in enumerate(_diffs()):
        patch = tmp_path / f"example{i}.patch"
        patch.write_text(diff)
        check = subprocess.run(
            ["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True
        )
        assert check.returncode == 0, f"docs/architecture.md's diff {i + 1} no longer applies: {check.stderr}"
        # a hunk git cannot read is skipped without an error: count what it would change
        stat = subprocess.run(
            ["git", "apply", "--numstat", str(patch)], cwd=ROOT, capture_output=True, text=True
        )
        assert {line.split("\t")[2] for line in stat.stdout.splitlines()} == _files(diff)
