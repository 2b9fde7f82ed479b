"""The main job exactly as README's first command runs it (slow: about 1.5 minutes)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_default_train_learns_and_reports_the_communication_saving(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "train"], capture_output=True, text=True, timeout=400, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "runs" / "diloco-k4-H50-s0" / "summary.json").read_text())
    assert summary["val_loss"] < 2.7  # a fresh model is at ln(256) = 5.5
    assert summary["dp_bytes_ratio"] == 50.0
    assert "50.0x fewer than data parallel" in proc.stdout
