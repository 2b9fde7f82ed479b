"""Codecs: how an outer_grad is encoded for the wire, and its real message size.

Every runtime, the simulator included, sends outer_grads through a codec, so lossy codecs have
the same effect everywhere and byte counts are real message sizes. Later codecs (bf16, int8,
4-bit, top-k) implement the same two methods.

    python -c "import torch; from diloco.codec import build_codec; \
print(build_codec('fp32').encode([torch.ones(3)]).nbytes)"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Encoded:
    """An encoded list of tensors: what would cross the network, and its size in bytes."""

    payload: list[torch.Tensor]
    nbytes: int


class Codec:
    """Encode a list of tensors into a message and decode it back (possibly lossily)."""

    name = "base"

    def encode(self, tensors: list[torch.Tensor]) -> Encoded:
        raise NotImplementedError

    def decode(self, message: Encoded) -> list[torch.Tensor]:
        raise NotImplementedError

    def message_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Size of the message for tensors of these shapes, without encoding them."""
        return self.encode(tensors).nbytes


class Fp32Codec(Codec):
    """The identity codec: values sent as they are, lossless (4 bytes each for float32 models,
    which is all diloco trains; a float64 model would send 8)."""

    name = "fp32"

    def encode(self, tensors: list[torch.Tensor]) -> Encoded:
        payload = [t.detach() for t in tensors]
        return Encoded(payload, tensor_bytes(payload))

    def decode(self, message: Encoded) -> list[torch.Tensor]:
        return message.payload

    def message_bytes(self, tensors: list[torch.Tensor]) -> int:
        return tensor_bytes(tensors)


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Size of tensors sent as they are (e.g. global parameters downloaded by a worker)."""
    return sum(t.numel() * t.element_size() for t in tensors)


_CODECS = {c.name: c for c in (Fp32Codec,)}


def build_codec(name: str) -> Codec:
    return _CODECS[name]()
