"""Work handed to a thread of its own, done in the order it was handed over: how the thread that
trains or applies updates writes metrics.jsonl and TensorBoard without waiting on them
(rundir/metrics.py).

    bg = Background("metrics")
    bg.submit(write_line, line)   # returns at once
    bg.join()                     # everything handed over so far is done (or its error raised)
    bg.close()
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class Background:
    """A thread that calls the functions handed to `submit`, one at a time, in order. The first
    one that raises stops the rest; its error is raised to the caller at the next `submit`,
    `join` or `close` (a full disk stops the run as it did when the write was the caller's)."""

    def __init__(self, name: str):
        self._work: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hand `fn(*args)` to the thread; returns at once."""
        self.raise_error()
        self._work.put((fn, args))

    def join(self) -> None:
        """Wait until everything handed over so far is done."""
        self._work.join()
        self.raise_error()

    def close(self) -> None:
        """Do what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join()
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._work.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure nothing more is done
                    item[0](*item[1])
            except Exception as e:
                self._error = e
            finally:
                self._work.task_done()
