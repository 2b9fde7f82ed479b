"""A pushed outer_grad checked before it touches anything (handlers.py's Push): it must be a
message of this run's codec, of this model's (or fragment's) shapes and dtypes, decodable, and
finite when it says so. Read in place from its push file (wal.Spool), whose pages are then let
go: a push waiting to be applied holds no memory of the server's.

    python -m pytest tests/integration/test_server_security.py
"""

from __future__ import annotations

import math

import torch

from diloco.core.codec import Encoded
from diloco.errors import UserError
from diloco.runtime.server import wal


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
        try:
            grads = st.side.codec.decode(message)  # e.g. topk indices out of order or range
        except UserError as e:
            refuse("malformed", str(e).removesuffix(" resend it.").rstrip(";."))
        # one fused pass: the norm is finite exactly when every value is (or it overflows)
        total = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        del grads
        if not math.isfinite(total):
            detail = f"job {jid}'s outer_grad has NaN or Inf values (or overflows) but says it is finite"
            refuse("nonfinite", detail)
        norm = total / math.sqrt(max(1, head.steps))  # the steps it took (checked by the caller)
    wal.release(buf)  # read again from the page cache when it is applied
    return message, norm
