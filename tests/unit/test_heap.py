"""runtime/server/heap.py against glibc itself, in a fresh process each: the arena limit is what
malloc_stats reports after many threads allocated, give_back returns the holes that freed
tensors left in the heap, and with map_large a freed tensor of 4 MB goes back at once (RSS from
/proc)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diloco.runtime.server import heap

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="the C library is not glibc")

ARENAS = """
import ctypes, threading, torch
from diloco.runtime.server import heap
if {limit}:
    heap.limit_arenas({limit})
keep, together = [], threading.Barrier(8)
def work():
    keep.append(torch.ones(1 << 14))  # 64 KB from this thread's arena
    together.wait()  # all eight alive at once (an ended thread's arena is reused)
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
ctypes.CDLL("libc.so.6").malloc_stats()  # one "Arena i:" block per arena, on stderr
"""

HEAP = """
import torch
from diloco.runtime.server import heap
{setup}
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = torch.ones(4 << 20)
del big  # a 16 MB block freed: glibc serves blocks up to 16 MB from the heap from now on
blocks = [torch.ones(1 << 20) for _ in range(100)]  # 100 x 4 MB, touched
before = rss()
del blocks[::2]  # every other one freed: 200 MB between live blocks
{then}
print((before - rss()) / 1e6)  # MB handed back to the system
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.timeout(120)
def test_the_arena_limit_holds_however_many_threads_allocate():
    unlimited = _run(ARENAS.format(limit=0))
    limited = _run(ARENAS.format(limit=2))
    assert unlimited.returncode == 0 and limited.returncode == 0, limited.stderr
    assert unlimited.stderr.count("Arena ") > 2  # glibc alone: an arena per thread (up to 8 per core)
    assert limited.stderr.count("Arena ") == 2


@pytest.mark.timeout(120)
def test_give_back_returns_the_holes_freed_tensors_left():
    out = _run(HEAP.format(setup="", then="heap.give_back()"))
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) > 150  # of the 200 MB of holes


@pytest.mark.timeout(120)
def test_with_map_large_a_freed_4_mb_tensor_goes_back_at_once():
    default = _run(HEAP.format(setup="", then=""))
    mapped = _run(HEAP.format(setup="heap.map_large()", then=""))
    assert default.returncode == 0 and mapped.returncode == 0, mapped.stderr
    assert float(default.stdout) < 50  # glibc alone keeps the holes between live blocks
    assert float(mapped.stdout) > 150  # of the 200 MB freed


HUGE = """
import sys
sys.argv = {argv!r}  # as the package's first import sees them under `python -m diloco ...`
import diloco, torch
x = torch.ones(16 << 20)  # 64 MB, touched
print(sum(int(line.split()[1]) for line in open("/proc/self/smaps") if line.startswith("AnonHugePages")))
"""


def _thp() -> str:
    try:
        return open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "[never]"


@pytest.mark.timeout(120)
@pytest.mark.skipif("[never]" in _thp(), reason="transparent huge pages are off in this kernel")
def test_diloco_serve_puts_large_tensors_in_huge_pages_and_nothing_else_does():
    serve, train = _run(HUGE.format(argv=["-m", "serve"])), _run(HUGE.format(argv=["-m", "train"]))
    assert serve.returncode == 0 and train.returncode == 0, serve.stderr
    assert int(serve.stdout) >= 32 << 10  # kB: most of the 64 MB in 2 MB pages
    assert int(train.stdout) == 0 or "[always]" in _thp()  # with "always" the kernel does it anyway
