"""Metrics: metrics.jsonl (one JSON object a line), TensorBoard event files, the summary.

Every line has `kind` (`inner`, `worker`, `outer`, `eval`; `rejected` from the server),
`version`, `inner_step`, `tokens`, `wall_time_s` and, in the simulator, `sim_time_s`; see
README.md, "The run directory". Plots and benchmarks read these files; nothing parses console
output.

metrics.jsonl is strict JSON: a non-finite number (a diverged loss, its perplexity) is written as
`null` (`json_safe`), never as the `NaN`/`Infinity` literals that other JSON readers reject; other
JSON a run writes or prints as results goes through `to_json` too (checkpoint.atomic_write_json,
`diloco eval --json`, `diloco replay`, the status page); the server's event log keeps its numbers
exactly as they were, for replay. TensorBoard gets such
values as they are (it plots NaN and Inf), so a divergence stays visible there.

    tensorboard --logdir runs/
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diloco.errors import UserError
from diloco.rundir.background import Background


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, ±Inf) replaced by None, recursively through dicts,
    lists and tuples (tuples become lists, as JSON has them); everything else is unchanged."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def to_json(obj: Any, **kwargs: Any) -> str:
    """`obj` as strict JSON: non-finite floats become null (`json_safe`), never `NaN`/`Infinity`.
    Every result diloco writes or prints as JSON goes through here."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def perplexity(loss: float | None) -> float | None:
    """exp(loss), or None when the loss is None or not finite or exp overflows (a diverged loss
    such as 1e4): a perplexity is then not a number worth writing."""
    if loss is None:
        return None
    loss = float(loss)
    if not math.isfinite(loss):
        return None
    try:
        return math.exp(loss)
    except OverflowError:
        return None


class MetricsWriter:
    """Appends metric lines to run_dir/metrics.jsonl and scalars to TensorBoard, from a thread of
    its own: `log` only queues the line, so the thread that trains or applies updates (the
    server's main thread) never waits on the file or on TensorBoard. Lines are written in the
    order they were logged (from any thread); `flush` waits until they are all in the file.

    On resume, `truncate_to` cuts metrics.jsonl back to its size when the checkpoint was saved
    and `purge_step` makes TensorBoard drop the events after it, so no line appears twice.
    Lines are strict JSON: non-finite numbers are written as null (TensorBoard gets them as is).
    """

    def __init__(self, run_dir: Path, *, truncate_to: int | None = None, purge_step: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        if truncate_to is not None:
            with open(self.path, "r+b") as f:
                f.truncate(truncate_to)
        self._file = open(self.path, "a")
        from torch.utils.tensorboard import SummaryWriter  # imported late: it is slow to load

        self._tb = SummaryWriter(str(run_dir), purge_step=purge_step)
        self._writer = Background("metrics")  # writes the lines (and TensorBoard's scalars) in order

    def log(self, kind: str, **fields: Any) -> None:
        """Queue one line (written by the writer's thread, in order)."""
        self._writer.submit(self._write, {"kind": kind, **fields})

    def flush(self) -> None:
        """Wait until every line logged so far is in metrics.jsonl and handed to TensorBoard."""
        self._writer.join()

    def offset(self) -> int:
        """Bytes written so far (every line logged); stored in checkpoints for `truncate_to`."""
        self.flush()
        os.fsync(self._file.fileno())  # a durable checkpoint must not point past the file's end
        return os.path.getsize(self.path)

    def close(self) -> None:
        """Write what is queued, then close the file and TensorBoard's writer."""
        try:
            self._writer.close()
        finally:
            try:
                self._file.close()
            finally:
                with interrupts_deferred():
                    self._tb.close()

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(to_json(line) + "\n")
        self._file.flush()
        step = line.get("inner_step", 0)
        suffix = f"/worker{line['worker']}" if "worker" in line else ""
        kind = line["kind"]
        for key, value in line.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "worker":
                self._tb.add_scalar(f"{kind}/{key}{suffix}", value, step)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM wait until the block ends, then act as they would have.

    TensorBoard's writer hands events to its thread through a queue; a KeyboardInterrupt raised
    in the middle of the queue's wake-up loses it, and closing the writer then waits for the
    thread's next timed wake-up, up to 120 s (seen: Ctrl-C once in ~60 runs under load did not
    stop a run for over a minute; none in 100 since). Signals are taken, and their handlers set, in
    the main thread only: elsewhere nothing changes. Several signals in the block act once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    kinds = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in kinds}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for s in caught[:1]:  # the first one, as if it came now
            handler = before[s]
            if callable(handler):
                handler(s, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(s)


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """All lines of a run's metrics.jsonl (non-finite numbers read back as None). A last line
    without its newline (a writer killed mid-line) is left out; any other line that is not a JSON
    object is a UserError."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; is this a diloco run directory?") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not text; the run directory is corrupt.") from None
    lines = text.split("\n")
    if lines and lines[-1].strip():  # cut off: the writer died before the newline
        lines = lines[:-1]
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict) or "kind" not in value:
            raise UserError(f"{path}:{n} is not a metrics line (a JSON object with a kind); it is corrupt.")
        out.append(value)
    return out


def check_metrics_offset(run_dir: Path, offset: int) -> None:
    """Before a resume writes anything: metrics.jsonl must hold at least what it held when the
    checkpoint was saved (`truncate_to` cuts it back to that; a shorter file would be padded)."""
    path = run_dir / "metrics.jsonl"
    size = path.stat().st_size if path.is_file() else 0
    if size < offset:
        raise UserError(
            f"{path} holds {size} bytes, but held {offset} when the checkpoint was saved: restore the "
            "run's metrics.jsonl, or start a new run (--resume cannot rebuild the lines it lost)."
        )


class NullWriter:
    """Writes nothing: what the ranks other than 0 log to under torchrun."""

    def log(self, kind: str, **fields: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def offset(self) -> int:
        return 0

    def close(self) -> None:
        pass
