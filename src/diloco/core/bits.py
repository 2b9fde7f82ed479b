"""Bit-level pieces of the sparse codecs (codec.py's chunked top-k): integers packed in as few bits
as they need, and values quantized to a sign and a few magnitude levels per group.

    python -c "import torch; from diloco.core.bits import pack, unpack; \
print(unpack(pack(torch.tensor([5, 0, 4095]), 12), 12, 3))"
"""

from __future__ import annotations

import math

import torch

_BYTE = torch.arange(8, dtype=torch.uint8)


def index_bits(n: int) -> int:
    """Bits an offset into n values takes: ⌈log2 n⌉, at least one."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def packed_bytes(count: int, bits: int) -> int:
    """Bytes of `count` integers of `bits` bits each, packed."""
    return -(-count * bits // 8)


def pack(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below 2^bits, `bits` bits each (least significant first), as
    uint8 bytes: `packed_bytes(len(x), bits)` of them."""
    shifts = torch.arange(bits, device=x.device)
    flat = ((x.long().reshape(-1, 1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) << _BYTE.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The `count` integers `pack` made of `bits` bits each, as int64."""
    if data.dtype != torch.uint8 or data.numel() != packed_bytes(count, bits):
        raise ValueError(f"{count} values of {bits} bits need {packed_bytes(count, bits)} bytes")
    flat = ((data.reshape(-1, 1) >> _BYTE.to(data.device)) & 1).reshape(-1)[: count * bits]
    return (flat.view(count, bits).long() << torch.arange(bits, device=data.device)).sum(dim=1)


def quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `values` [rows, n] as codes of `bits` bits, a sign bit above bits − 1 bits of
    magnitude: 2^(bits−1) levels evenly spaced from the row's smallest |value| to its largest,
    both kept as bfloat16 `bounds` [rows, 2] and the levels placed between those rounded bounds,
    each magnitude to its nearest level. Returns (codes [rows·n] int64, bounds)."""
    mag = values.abs()
    bounds = torch.stack([mag.amin(dim=1), mag.amax(dim=1)], dim=1).to(torch.bfloat16)
    lo, step = _levels(bounds, bits)
    q = torch.round((mag - lo) / torch.where(step > 0, step, torch.ones_like(step)))
    q = torch.where(step > 0, q, torch.zeros_like(q)).clamp_(0, 2 ** (bits - 1) - 1).long()
    return (q | (values < 0).long() << (bits - 1)).reshape(-1), bounds


def dequantize(codes: torch.Tensor, bounds: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 values [rows, n] of `quantize`'s codes [rows, n] and bounds [rows, 2]."""
    lo, step = _levels(bounds, bits)
    mag = lo + (codes & (2 ** (bits - 1) - 1)).float() * step
    return torch.where(codes >> (bits - 1) > 0, -mag, mag)


def _levels(bounds: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest level, spacing) per row, as [rows, 1] float32."""
    lo, hi = bounds.float().unbind(dim=1)
    return lo[:, None], ((hi - lo) / (2 ** (bits - 1) - 1))[:, None]
