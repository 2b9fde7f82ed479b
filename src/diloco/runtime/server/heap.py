"""The server's resident memory held near what it uses (issue 33). glibc's malloc gives each
thread that allocates under contention its own arena (up to 8 per core) and keeps what a thread
freed in that arena for its next allocation; tensors below the mmap threshold (which grows to
32 MB after the first large free) come from the arenas. The server's many gRPC threads each
decode and check pushes of tens of MB, so freed pushes piled up in a dozen arenas: 20m fp4 ×
16 workers peaked 2.5 GB above idle with 1.1 GB allocated (memray). Two arenas bring that to
1.1-1.6 GB at the same throughput; the memory the start's evaluation freed is handed back once,
before serving. Handing freed memory back after every applied push was measured and not kept:
each push's tensors were then faulted in afresh (40% fewer pushes per second).

Two arenas did not stop the growth with more workers: 20m fp4 × 64 peaked 3.0-3.3 GB above
idle (1.6 GB at × 16). The blocks of 4-32 MB that a push's decode and outer step make and free
(a decoded tensor, its int32 codes) came from the heap, where the live blocks of 64 concurrent
streams between them kept the freed ones from going back. With blocks of 4 MB or more mapped on
their own (`map_large`: glibc's mmap threshold fixed at 4 MB) each goes back to the system when
freed: 20m fp4 × 64 +0.91-0.96 GB, 150m fp32 × 16 1.9 → 1.4 GB. Each such block is then faulted
in afresh: 4 KB pages cost 0.31 CPU s per push against 0.21, so `diloco serve` has PyTorch put
tensors of 2 MB or more in transparent huge pages (diloco/_before_torch.py): +0.78-0.92 GB at
0.22 s per push (results/server_capacity_map_large.json).

No-ops where the C library is not glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes

_M_ARENA_MAX = -8  # mallopt's parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
ARENAS = 2  # measured: 20m fp4 x 16 workers +2.4 GB over idle with glibc's default, +1.1-1.6 GB with 2
MAP_BYTES = 4 << 20  # measured: 20m fp4 x 64 workers +3.0-3.3 GB over idle with glibc's own, +0.8-0.9 GB


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def limit_arenas(n: int = ARENAS) -> None:
    """At most `n` malloc arenas from now on (call before the server's threads start)."""
    if _LIBC is not None and n > 0:
        _LIBC.mallopt(_M_ARENA_MAX, n)


def map_large(nbytes: int = MAP_BYTES) -> None:
    """Blocks of `nbytes` or more mapped on their own from now on, so freeing one hands it back
    to the system (glibc otherwise raises this threshold to 32 MB after the first large free)."""
    if _LIBC is not None and nbytes > 0:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, nbytes)


def give_back() -> None:
    """Return the heap's free memory to the system (every arena's; a few ms)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
