"""Metrics: metrics.jsonl (one JSON object a line), TensorBoard event files, the summary.

Every line has `kind` (`inner`, `worker`, `outer`, `eval`), `version`, `inner_step`, `tokens`,
`wall_time_s` and, in the simulator, `sim_time_s`; see README.md, "The run directory". Plots and
benchmarks read these files; nothing parses console output.

    tensorboard --logdir runs/
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends metric lines to run_dir/metrics.jsonl and scalars to TensorBoard.

    On resume, `truncate_to` cuts metrics.jsonl back to its size when the checkpoint was saved
    and `purge_step` makes TensorBoard drop the events after it, so no line appears twice.
    """

    def __init__(self, run_dir: Path, *, truncate_to: int | None = None, purge_step: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        if truncate_to is not None:
            with open(self.path, "r+b") as f:
                f.truncate(truncate_to)
        self._file = open(self.path, "a")
        from torch.utils.tensorboard import SummaryWriter  # imported late: it is slow to load

        self._tb = SummaryWriter(str(run_dir), purge_step=purge_step)

    def offset(self) -> int:
        """Bytes written so far; stored in checkpoints for `truncate_to`."""
        self._file.flush()
        return os.path.getsize(self.path)

    def log(self, kind: str, **fields: Any) -> None:
        line = {"kind": kind, **fields}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        step = fields.get("inner_step", 0)
        suffix = f"/worker{fields['worker']}" if "worker" in fields else ""
        for key, value in fields.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "worker":
                self._tb.add_scalar(f"{kind}/{key}{suffix}", value, step)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """All lines of a run's metrics.jsonl."""
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


class NullWriter:
    """Writes nothing: what the ranks other than 0 log to under torchrun."""

    def log(self, kind: str, **fields: Any) -> None:
        pass

    def offset(self) -> int:
        return 0

    def close(self) -> None:
        pass
