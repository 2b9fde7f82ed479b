"""How many pushes the server receives and checks at once (`--max-inflight-pushes`). A push
costs little memory now (it goes to its own file as it arrives, wal.Spool; its check maps it 64
MB at a time and at most one per core decodes, checks.py), so the limit mostly bounds open
files and gRPC threads busy with pushes. The rest wait their turn (gRPC's flow control holds
their senders back); none fails for it. docs/server.md, "Limits".
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

AUTO_SHARE = 0.25  # --max-inflight-pushes 0: as many pushes as this share of the memory available holds


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resolve(setting: int, message_bytes: int) -> int:
    """The limit: `setting`, or for 0 as many messages of `message_bytes` as a quarter of the
    memory available now holds (at least 1; 64 where the memory is not known)."""
    if setting:
        return setting
    free = available_bytes()
    return 64 if free is None else max(1, int(AUTO_SHARE * free) // max(1, message_bytes))


class PushSlots:
    """At most `limit` pushes received at once; `most` and `waited` say how it went."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free = threading.Semaphore(limit)
        self._lock = threading.Lock()
        self.now = self.most = self.waited = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        if not self._free.acquire(blocking=False):
            with self._lock:
                self.waited += 1
            self._free.acquire()
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            yield
        finally:
            with self._lock:
                self.now -= 1
            self._free.release()

    def figures(self) -> dict[str, int]:
        return {"limit": self.limit, "most_at_once": self.most, "waited": self.waited}
