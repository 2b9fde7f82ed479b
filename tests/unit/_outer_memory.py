"""Run by test_outer_side.py in a fresh process: the peak RSS an outer step adds (MB)."""

import sys
from pathlib import Path

import torch

from diloco.core import outer_side
from diloco.core.async_rules import DelayedNesterov
from diloco.core.codec import Encoded, Fp4Codec
from diloco.core.outer_side import OuterSide
from diloco.runtime.server import wal

torch.set_num_threads(1)
MB = 1 << 20


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def now_mb() -> float:
    """The resident set now; the peak (VmHWM) starts again from here (Linux's clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mb("VmRSS")


def main(what: str, k: int) -> None:
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2 * MB)) for _ in range(8)])  # 64 MB
    grads = [torch.full((2 * MB,), 0.5) for _ in range(8)]
    if what == "reduce":  # fp32: every message is a view of the same 64 MB
        side = OuterSide(model, k)
        side.begin_round()
        messages = [side.codec.encode(grads) for _ in range(k)]
        for w in range(k):
            side.report(w, messages[w].nbytes, True)
        before = now_mb()
        side.reduce(messages)
    elif what.startswith("mapped"):  # an fp32 push read in place from its mapped file (the server)
        outer_side.PART_BYTES = 8 * MB
        side = OuterSide(model, 2, update=DelayedNesterov(0.7, 0.9, size=2))
        side.update.prepare(side.params)
        if what == "mapped":  # as ServerState sets it
            side.after_read = wal.release_read
        path = Path(sys.argv[3]) / f"push-{what}"  # runs side by side: a file each
        path.write_bytes(side.codec.encode(grads).to_bytes())
        message = Encoded.from_bytes(wal.map_file(path))
        del grads
        before = now_mb()
        side.apply_async(0, message, steps=1, staleness=0)
    else:  # an async apply of a 64 MB model's fp4 push (8 MB), a part at a time or whole
        outer_side.PART_BYTES = 8 * MB if what == "parts" else 1 << 40
        side = OuterSide(model, 2, update=DelayedNesterov(0.7, 0.9, size=2), codec=Fp4Codec())
        side.update.prepare(side.params)
        message = side.codec.encode(grads)
        del grads
        before = now_mb()
        side.apply_async(0, message, steps=1, staleness=0)
    print(round(status_mb("VmHWM") - before, 1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
