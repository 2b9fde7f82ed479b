"""The codec interface (codec.py has the codecs and their registry): `Codec`, and the pieces every
codec shares: a message's size as sent, the finiteness check of lossy codecs, and reading a
message whose payload holds a fixed number of parts per tensor.

    python -m pytest tests/unit/test_codec.py
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from diloco.core.encoded import Encoded
from diloco.errors import UserError


class Codec:
    """Encode a list of tensors into a message and decode it back (possibly lossily).

    Subclasses implement `_encode` and `_decode`; with `error_feedback`, `encode` adds the
    worker's residual (in `state`) before encoding and keeps what the message left out."""

    name = "base"
    summable = False  # True: the decoded float32 messages are all-reduced (exact sums)
    lossy = True

    def __init__(self, *, error_feedback: bool = False, ef_decay: float = 1.0):
        self.error_feedback, self.ef_decay = error_feedback, ef_decay

    def encode(self, tensors: list[torch.Tensor], state: dict[str, Any] | None = None) -> Encoded:
        """The message for `tensors`. `state` is the sending worker's own dict (None: stateless,
        no error feedback); with error feedback its "residual" is updated in place."""
        if self.lossy:
            _check_finite(tensors)
        with torch.no_grad():
            feedback = self.error_feedback and state is not None
            if feedback and "residual" in state:  # e ← β e + Δ (SparseLoCo's accumulator; β = 1: plain)
                residual = [r.to(t.device) for t, r in zip(tensors, state["residual"], strict=True)]
                if self.ef_decay != 1.0:
                    residual = [r * self.ef_decay for r in residual]
                tensors = [t + r for t, r in zip(tensors, residual, strict=True)]
            message = self._encode([t.detach() for t in tensors])
            if feedback:
                decoded = self._decode(message)
                state["residual"] = [
                    (t - d.to(t.device)).cpu() for t, d in zip(tensors, decoded, strict=True)
                ]
        return message

    def decode(self, message: Encoded) -> list[torch.Tensor]:
        """The float32 tensors a message stands for; a message that does not hold together (a
        damaged or hostile one) is a UserError."""
        return list(self.decode_each(message))

    def decode_each(self, message: Encoded) -> Iterator[torch.Tensor]:
        """`decode`'s tensors one at a time, so a caller can hold one tensor instead of the whole
        decoded message (the server's checks: a decoded fp4 push of 150m is 693 MB)."""
        self.check(message)
        try:
            yield from self._decode(message)
        except (RuntimeError, ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
            raise UserError(
                f"an outer_grad message of codec {self.name!r} does not decode ({e}); resend it."
            ) from None

    def _encode(self, tensors: list[torch.Tensor]) -> Encoded:
        raise NotImplementedError

    def _decode(self, message: Encoded) -> Iterable[torch.Tensor]:
        raise NotImplementedError

    def message_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Size of the message for tensors of these shapes, without encoding them (meta tensors
        will do)."""
        return sum(self.tensor_message_bytes(t.numel()) for t in tensors)

    def tensor_message_bytes(self, n: int) -> int:
        """The bytes one tensor of n values takes in a message (tests check it against `encode`)."""
        raise NotImplementedError

    def check(self, message: Encoded) -> None:
        if message.codec != self.name:
            raise UserError(
                f"an outer_grad message was encoded with codec {message.codec!r} but this run uses "
                f"{self.name!r}; run every worker with the same --codec."
            )


def _check_finite(tensors: list[torch.Tensor]) -> None:
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise ValueError("a lossy codec cannot encode NaN or Inf values; report the outer_grad as non-finite")


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Size of tensors sent as they are (e.g. global parameters downloaded by a worker)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def per_tensor(message: Encoded, parts: int = 2) -> list[tuple[list[int], int, list[torch.Tensor]]]:
    """(shape, numel, its parts) of each tensor of a message whose payload holds `parts` parts
    per tensor and whose meta holds the shapes (fp4, topk)."""
    shapes = message.meta["shapes"]
    if not isinstance(shapes, list) or parts * len(shapes) != len(message.payload):
        raise ValueError(f"{len(message.payload)} tensors for {len(shapes)} shapes")
    out = []
    for i, shape in enumerate(shapes):
        shape = [int(d) for d in shape]
        if any(d < 0 for d in shape) or math.prod(shape) >= 2**31:
            raise ValueError(f"shape {shape} is negative or too large for int32 indices")
        out.append((shape, math.prod(shape), message.payload[parts * i : parts * (i + 1)]))
    return out
