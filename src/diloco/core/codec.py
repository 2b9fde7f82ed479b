"""Codecs: how an outer_grad is encoded for the wire, and its real message size.

Every runtime, the simulator included, sends outer_grads through a codec, so lossy codecs have
the same effect everywhere and byte counts are real message sizes (values, scales, indices).
A codec:

- encodes on the worker (`encode(tensors, state)`), where `state` is that worker's own dict,
  kept across rounds and saved in checkpoints with the worker: with error feedback it holds
  what earlier messages left out (the residual), added to the next outer_grad before encoding;
  and decodes on the outer side (`decode(message)`), always to float32;
- says whether its decoded messages can be summed exactly in float32 by an all-reduce
  (`summable`: fp32 and bf16): the collective runtime then all-reduces w_i × decode(message_i);
  otherwise it all-gathers the encoded messages and every rank decodes and sums them in worker
  order. The simulator sums in worker order too, so both compute the same numbers;
- produces an `Encoded` (encoded.py) that becomes bytes and back (`to_bytes`,
  `Encoded.from_bytes`: a safetensors blob with the codec's name in its metadata), as a server
  sends it;
- knows its message's size from the tensors' shapes alone (`message_bytes`: no encoding, so
  `diloco plan` sizes a 10B model's messages at once).

The codecs (docs/communication.md has their bytes per value and what they cost in loss):

- `fp32`: as is, 4 bytes per value. `bf16`: bfloat16 values (round to nearest even), 2 bytes.
- `int8`: symmetric absmax scaling per block of 256 consecutive values of each tensor:
  q = round(x × 127 / absmax) in [-127, 127], one float32 scale (absmax / 127) per block:
  1 + 4/256 bytes. Blocks rather than one scale per tensor, so that one outlier costs precision
  in its own 256 values only; symmetric, so zero and signs are exact.
- `fp4`: Streaming DiLoCo's 4-bit E3M0: a sign bit and 3 exponent bits, no mantissa. Per block
  of 256 values, magnitudes are |x| / absmax rounded to the nearest of {0, 2^-6, 2^-5, ..., 2^0}
  (code 0 is zero, code m = 1..7 is 2^(m-7)); two codes per byte plus one float32 absmax per
  block: 1/2 + 4/256 bytes.
- `topk`: the `fraction` largest |values| of each tensor (at least one), as float32 values and
  int32 indices: 8 × fraction bytes per value; or per chunk of `chunk` values, with offsets in
  ⌈log2 chunk⌉ bits and the values in `bits` 2 or 3 (SparseLoCo's layout; `TopKCodec`).

Lossy codecs refuse NaN and Inf (a worker never encodes a non-finite outer_grad: it reports it).
Everything is vectorised torch on the tensors' own device (CPU or GPU).
    python -c "import torch; from diloco.core.codec import build_codec; \
print(build_codec('fp4').encode([torch.ones(1000)]).nbytes)"
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from diloco.core.codec_base import Codec, per_tensor, tensor_bytes
from diloco.core.encoded import Encoded
from diloco.core.topk import TOPK_BITS, TopKCodec

__all__ = [
    "CODECS",
    "DOWNLOAD_CODECS",
    "TOPK_BITS",
    "Codec",
    "Encoded",
    "TopKCodec",
    "build_codec",
    "tensor_bytes",
]


class Fp32Codec(Codec):
    """The identity codec: values sent as they are, lossless (4 bytes each for float32 models,
    which is all diloco trains; a float64 model would send 8)."""

    name = "fp32"
    summable = True
    lossy = False

    def _encode(self, tensors: list[torch.Tensor]) -> Encoded:
        return Encoded(self.name, tensors, tensor_bytes(tensors))

    def _decode(self, message: Encoded) -> Iterable[torch.Tensor]:
        return message.payload

    def message_bytes(self, tensors: list[torch.Tensor]) -> int:
        return tensor_bytes(tensors)

    def tensor_message_bytes(self, n: int) -> int:  # a float32 tensor
        return 4 * n


class Bf16Codec(Codec):
    """bfloat16 values (round to nearest even), 2 bytes each, decoded to float32 exactly; the
    collective runtime all-reduces the weighted float32 contributions (as for fp32: the same
    numbers as the simulator's sum in worker order bit for bit with 2 workers, within float
    rounding with more, whose sums gloo orders its own way)."""

    name = "bf16"
    summable = True

    def _encode(self, tensors: list[torch.Tensor]) -> Encoded:
        payload = [t.to(torch.bfloat16) for t in tensors]
        return Encoded(self.name, payload, tensor_bytes(payload))

    def tensor_message_bytes(self, n: int) -> int:
        return 2 * n

    def _decode(self, message: Encoded) -> Iterable[torch.Tensor]:
        if any(t.dtype != torch.bfloat16 for t in message.payload):
            raise ValueError("its values are not bfloat16")
        yield from (t.float() for t in message.payload)


BLOCK = 256  # values per scale of the int8 and fp4 codecs


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """t flattened and zero-padded to whole blocks: [blocks, BLOCK]."""
    flat = t.reshape(-1).float()
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def _num_blocks(n: int) -> int:
    return -(-n // BLOCK)


class Int8Codec(Codec):
    """Symmetric absmax int8 per block of 256 values (module docstring), one float32 scale per
    block. Payload per tensor: its int8 values in the tensor's shape, then its scales."""

    name = "int8"

    def tensor_message_bytes(self, n: int) -> int:
        return n + 4 * _num_blocks(n)

    def _encode(self, tensors: list[torch.Tensor]) -> Encoded:
        payload = []
        for t in tensors:
            blocks = _blocks(t)
            scale = blocks.abs().amax(dim=1) / 127.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
            payload += [q.reshape(-1)[: t.numel()].reshape(t.shape), scale]
        return Encoded(self.name, payload, tensor_bytes(payload))

    def _decode(self, message: Encoded) -> Iterable[torch.Tensor]:
        for q, scale in zip(message.payload[0::2], message.payload[1::2], strict=True):
            if (
                q.dtype != torch.int8
                or scale.dtype != torch.float32
                or scale.numel() != _num_blocks(q.numel())
            ):
                raise ValueError("values must be int8 with one float32 scale per 256 of them")
            yield (_blocks(q) * scale[:, None]).reshape(-1)[: q.numel()].reshape(q.shape)


class Fp4Codec(Codec):
    """4-bit E3M0 per block of 256 values (module docstring): code = sign << 3 | m, m = 0 for
    zero and 1..7 for 2^(m-7) × absmax; two codes per byte (even index in the low nibble).
    Payload per tensor: packed codes (ceil(n/2) bytes), then its float32 absmax per block;
    meta: the shapes."""

    name = "fp4"

    def tensor_message_bytes(self, n: int) -> int:
        return -(-n // 2) + 4 * _num_blocks(n)

    def _encode(self, tensors: list[torch.Tensor]) -> Encoded:
        payload = []
        for t in tensors:
            blocks = _blocks(t)
            scale = blocks.abs().amax(dim=1)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            r = blocks.abs() / safe[:, None]  # in [0, 1]
            mant, exp = torch.frexp(r)  # r = mant × 2^exp, mant in [0.5, 1): floor(log2 r) = exp − 1
            e = (exp - 1 + (mant > 0.75).to(exp.dtype)).clamp_(-6, 0)  # nearest power of two
            m = torch.where(r < 2.0**-7, torch.zeros_like(e), e + 7).to(torch.uint8)  # below 2^-7: zero
            codes = m | ((blocks < 0) & (m > 0)).to(torch.uint8) << 3
            codes = codes.reshape(-1)[: t.numel() + t.numel() % 2]
            payload += [codes[0::2] | codes[1::2] << 4, scale]
        shapes = [list(t.shape) for t in tensors]
        return Encoded(self.name, payload, tensor_bytes(payload), {"shapes": shapes})

    def _decode(self, message: Encoded) -> Iterable[torch.Tensor]:
        for shape, n, (packed, scale) in per_tensor(message):
            if packed.dtype != torch.uint8 or packed.numel() != -(-n // 2) or scale.dtype != torch.float32:
                raise ValueError(f"a tensor of shape {shape} needs {-(-n // 2)} bytes of uint8 codes")
            if scale.numel() != _num_blocks(n):
                raise ValueError(f"a tensor of shape {shape} needs {_num_blocks(n)} float32 scales")
            pairs = _FP4_PAIRS[packed.int()].view(torch.float32)
            full = _num_blocks(n) * BLOCK
            if pairs.numel() < full:
                pairs = torch.cat([pairs, pairs.new_zeros(full - pairs.numel())])
            yield pairs.view(-1, BLOCK).mul_(scale[:, None]).reshape(-1)[:n].reshape(shape)


def _fp4_pairs() -> torch.Tensor:
    """byte -> (low nibble's, high nibble's) unit value as one int64 (two float32), so a decode
    reads each byte's two values at once (8x faster than nibble by nibble, the same bits)."""
    codes = torch.arange(16, dtype=torch.int32)
    m = codes & 7
    magnitude = torch.where(m > 0, torch.ldexp(torch.ones(16), m - 7), 0.0)
    unit = torch.where(codes >= 8, -magnitude, magnitude)
    byte = torch.arange(256)
    return torch.stack([unit[byte & 15], unit[byte >> 4]], dim=1).contiguous().view(torch.int64).reshape(-1)


_FP4_PAIRS = _fp4_pairs()


CODECS: dict[str, type[Codec]] = {c.name: c for c in (Fp32Codec, Bf16Codec, Int8Codec, Fp4Codec, TopKCodec)}
DOWNLOAD_CODECS = ("fp32", "bf16")  # what global parameters may be downloaded as (docs/communication.md)


def build_codec(
    name: str,
    *,
    error_feedback: bool = False,
    ef_decay: float = 1.0,
    topk_fraction: float = 0.01,
    topk_chunk: int = 0,
    topk_bits: int = 32,
) -> Codec:
    """The codec called `name`; the `topk_` settings are used by topk only."""
    feedback = {"error_feedback": error_feedback, "ef_decay": ef_decay}
    if name == "topk":
        return TopKCodec(fraction=topk_fraction, chunk=topk_chunk, bits=topk_bits, **feedback)
    return CODECS[name](**feedback)
