"""The threads of a process that trains (`diloco train`, `diloco worker`, `diloco replay`, the
finished-run verbs): intra-op threads as configured, one inter-op thread.

    python -c "from diloco.run.threads import set_threads; set_threads(1)"
"""

from __future__ import annotations

import os
import sys

import torch

from diloco.config.sections import MAX_THREADS
from diloco.errors import UserError


def set_threads(threads: int) -> None:
    """Intra-op threads as configured; one inter-op thread (small models gain nothing more). More
    threads than this process's cores only slow it down: a warning says so."""
    cores = len(os.sched_getaffinity(0))
    if not 0 <= threads <= MAX_THREADS:
        raise UserError(
            f"--threads must be from 0 to {MAX_THREADS}, got {threads}; use --threads {cores} or fewer."
        )
    if threads > cores:
        print(
            f"diloco: warning: --threads {threads} is more than the {cores} cores this process may use, "
            f"which makes it slower; use --threads {cores} or fewer.",
            file=sys.stderr,
            flush=True,
        )
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # may be set only once per process, before any parallel work
        pass
