"""A pushed outer_grad checked before it touches anything (handlers.py's Push): it must be a
message of this run's codec, of this model's (or fragment's) shapes and dtypes, decodable, and
finite when it says so. Read in place from its push file (wal.Spool), whose pages are then let
go: a push waiting to be applied holds no memory of the server's.

    python -m pytest tests/integration/test_server_security.py
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable

import torch

from diloco.core import outer_side
from diloco.core.codec import Encoded
from diloco.core.outer import in_groups
from diloco.errors import UserError
from diloco.runtime.server import wal

# pushes decoded and measured at once: one per core this process may use (the work is a core's;
# more at once only hold more decoded outer_grads: 16 fp4 pushes of a 20m model took 5.4 GB)
CHECKING = threading.BoundedSemaphore(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def check_push(st, buf, head, refuse) -> tuple[Encoded, float | None]:
    """(the message in `buf`, its norm per √step, None when it says it is not finite); a push
    that fails a check is refused (`refuse` raises)."""
    jid, p = head.job, head.fragment - 1  # p: -1 for a whole outer_grad
    expected_message, expected_meta, _ = st.expected(p)
    try:
        message = Encoded.from_bytes(buf)
        st.side.codec.check(message)
    except UserError as e:
        refuse("malformed", str(e).removesuffix(" resend it.").rstrip(";."))
    got = [(tuple(t.shape), t.dtype) for t in message.payload]
    if got != expected_message or message.meta != expected_meta:
        what = f"fragment {p} of job {jid}'s outer_grad" if p >= 0 else f"job {jid}'s outer_grad"
        refuse("shape", f"{what} does not have this model's shapes and dtypes")
    norm = None
    if head.finite:  # an outer_grad flagged non-finite is dropped by the rule (--on-nonfinite drop)
        with CHECKING:  # decoding takes a core, and memory: a group of tensors at a time
            try:  # e.g. topk indices out of order or range
                norms = _norms(st.side.codec.decode_each(message), message)
            except UserError as e:
                refuse("malformed", str(e).removesuffix(" resend it.").rstrip(";."))
            # the norm is finite exactly when every value is (or it overflows)
            total = float(torch.linalg.vector_norm(torch.stack(norms)))
        if not math.isfinite(total):
            detail = f"job {jid}'s outer_grad has NaN or Inf values (or overflows) but says it is finite"
            refuse("nonfinite", detail)
        norm = total / math.sqrt(max(1, head.steps))  # the steps it took (checked by the caller)
    wal.release(buf)  # read again from the page cache when it is applied
    return message, norm


def _norms(grads: Iterable[torch.Tensor], message: Encoded) -> list[torch.Tensor]:
    """Each tensor's norm, decoded one at a time and measured in fused passes over groups of
    about PART_BYTES (as the outer step reads it); the mapped pages behind a group (tensors that
    view the push file: fp32's) are let go once it is done, so a check holds a group of a message
    in memory, not the message (decoded, an fp4 push of 150m is 693 MB)."""
    norms = []
    for group in in_groups(grads, outer_side.PART_BYTES):
        norms.extend(torch._foreach_norm(group))
        wal.release_read(message, group)
    return norms
