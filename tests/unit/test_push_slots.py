"""--max-inflight-pushes (runtime/server/slots.py): at most `limit` pushes received at once, the
rest wait (none fails), and 0 resolves from the memory available."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.runtime.server import slots


@pytest.mark.timeout(30)
def test_at_most_limit_at_once_and_the_rest_wait():
    s = slots.PushSlots(2)
    done = []

    def push(i: int) -> None:
        with s.slot():
            time.sleep(0.05)
        done.append(i)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(done) == list(range(6))
    assert s.figures() == {"limit": 2, "most_at_once": 2, "waited": s.waited} and s.waited >= 1 and s.now == 0


@pytest.mark.timeout(10)
def test_zero_resolves_from_the_memory_available():
    assert slots.resolve(3, 10**9) == 3
    free = slots.available_bytes()
    assert free is not None and free > 0
    assert slots.resolve(0, 10**15) == 1  # a message larger than memory: one at a time
    n = slots.resolve(0, 10**6)  # a quarter of the memory available, in 1 MB messages (it moves a little)
    assert 0.2 * free / 10**6 <= n <= 0.3 * free / 10**6
