"""The server's resident memory held near what it uses (issue 33). glibc's malloc gives each
thread that allocates under contention its own arena (up to 8 per core) and keeps what a thread
freed in that arena for its next allocation; tensors below the mmap threshold (which grows to
32 MB after the first large free) come from the arenas. The server's many gRPC threads each
decode and check pushes of tens of MB, so freed pushes piled up in a dozen arenas: 20m fp4 ×
16 workers peaked 2.5 GB above idle with 1.1 GB allocated (memray). Two arenas bring that to
1.1-1.6 GB at the same throughput; the memory the start's evaluation freed is handed back once,
before serving. Handing freed memory back after every applied push was measured and not kept:
each push's tensors were then faulted in afresh (40% fewer pushes per second).

No-ops where the C library is not glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes

_M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)
ARENAS = 2  # measured: 20m fp4 x 16 workers +2.4 GB over idle with glibc's default, +1.1-1.6 GB with 2


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


def give_back() -> None:
    """Return the heap's free memory to the system (every arena's; a few ms)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
