"""The top-k codec (codec.py's `topk`): the largest |values| of each tensor, or of each chunk of
it with offsets and values in as few bits as they need (SparseLoCo's layout; bits.py).

    python -c "import torch; from diloco.core.topk import TopKCodec; \
print(TopKCodec(fraction=0.03, chunk=4096, bits=2).encode([torch.randn(10000)]).nbytes)"
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from diloco.core.bits import dequantize, index_bits, pack, packed_bytes, quantize, unpack
from diloco.core.codec_base import Codec, per_tensor, tensor_bytes
from diloco.core.encoded import Encoded

TOPK_BITS = (2, 3, 32)  # --topk-bits: the kept values' bits (32: float32 as they are)


class TopKCodec(Codec):
    """The `fraction` largest |values| of each tensor (at least one); meta: the shapes, chunk and
    bits. Without error feedback the rest is lost every round (the DiLoCo paper prunes 50% at
    +0.4% perplexity). By default float32 values and int32 indices into the flattened tensor.
    With `chunk` C > 0 (--topk-chunk) the top-k is taken in each chunk of C consecutive values
    (the last one shorter), each keeping ⌈fraction × its length⌉, and indices are offsets in
    their chunk, ⌈log2 C⌉ bits each, bit-packed (SparseLoCo's layout: 12 bits for C = 4096).
    With `bits` 2 or 3 (--topk-bits) the kept values of each chunk are a sign and 2^(bits−1)
    magnitudes from its smallest to its largest kept one (bits.py `quantize`; two bfloat16 a
    chunk). Payload per tensor: values (or packed codes) and indices, then the chunks' bounds."""

    name = "topk"

    def __init__(
        self,
        *,
        fraction: float = 0.01,
        chunk: int = 0,
        bits: int = 32,
        error_feedback: bool = False,
        ef_decay: float = 1.0,
    ):
        super().__init__(error_feedback=error_feedback, ef_decay=ef_decay)
        if not 0 < fraction <= 1:
            raise ValueError(f"the top-k fraction must be in (0, 1], got {fraction}")
        if chunk < 0 or bits not in TOPK_BITS:
            raise ValueError(
                f"top-k chunks must be ≥ 0 values and bits one of {TOPK_BITS}; got {chunk}, {bits}"
            )
        self.fraction, self.chunk, self.bits = fraction, chunk, bits

    def keep(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.fraction * n)))

    @property
    def plain(self) -> bool:  # the layout of float32 values and int32 indices
        return not self.chunk and self.bits == 32

    def _rows(self, n: int) -> list[tuple[int, int]]:
        """(chunks, values in each) of a tensor of n values: whole chunks, then a shorter one."""
        if n == 0:
            return []
        c = self.chunk if 0 < self.chunk < n else n
        return [(r, length) for r, length in ((n // c, c), (1 if n % c else 0, n % c)) if r]

    def _offset_bits(self, n: int) -> int:
        """Bits of one offset in a tensor of n values: enough for its (first) chunk."""
        rows = self._rows(n)
        return index_bits(rows[0][1]) if rows else 1

    def _kept(self, n: int) -> int:
        """Values kept of a tensor of n values (every chunk its own ⌈fraction × length⌉)."""
        return sum(r * self.keep(length) for r, length in self._rows(n))

    def tensor_message_bytes(self, n: int) -> int:
        if self.plain:
            return 8 * self.keep(n)
        rows, kept = self._rows(n), self._kept(n)
        values = 4 * kept if self.bits == 32 else packed_bytes(kept, self.bits) + 4 * sum(r for r, _ in rows)
        return values + packed_bytes(kept, self._offset_bits(n))

    def _encode(self, tensors: list[torch.Tensor]) -> Encoded:
        payload = []
        for t in tensors:
            flat = t.reshape(-1).float()
            if self.plain:
                index = torch.topk(flat.abs(), self.keep(flat.numel()), sorted=False).indices.sort().values
                payload += [flat[index], index.to(torch.int32)]
                continue
            offsets, values, at = [torch.zeros(0, dtype=torch.long)], [flat.new_zeros(0, 1)], 0
            for r, length in self._rows(flat.numel()):
                block = flat[at : at + r * length].view(r, length)
                idx = (
                    torch.topk(block.abs(), self.keep(length), dim=1, sorted=False).indices.sort(dim=1).values
                )
                offsets.append(idx.reshape(-1))
                values.append(block.gather(1, idx))
                at += r * length
            index = pack(torch.cat(offsets), self._offset_bits(flat.numel()))
            if self.bits == 32:
                payload += [torch.cat([v.reshape(-1) for v in values]), index]
            else:
                codes, bounds = zip(*(quantize(v, self.bits) for v in values), strict=True)
                payload += [pack(torch.cat(codes), self.bits), index, torch.cat(bounds)]
        meta = {"shapes": [list(t.shape) for t in tensors], "chunk": self.chunk, "bits": self.bits}
        return Encoded(self.name, payload, tensor_bytes(payload), meta)

    def _decode(self, message: Encoded) -> Iterable[torch.Tensor]:
        if (message.meta.get("chunk", 0), message.meta.get("bits", 32)) != (self.chunk, self.bits):
            raise ValueError(
                f"it was encoded with --topk-chunk {message.meta.get('chunk', 0)} --topk-bits "
                f"{message.meta.get('bits', 32)}, this run uses {self.chunk} and {self.bits}"
            )
        parts = 2 if self.bits == 32 else 3
        for shape, n, tensor_parts in per_tensor(message, parts):
            yield (self._plain_decode if self.plain else self._chunk_decode)(n, *tensor_parts).reshape(shape)

    @staticmethod
    def _plain_decode(n: int, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if values.dtype != torch.float32 or index.dtype != torch.int32 or values.shape != index.shape:
            raise ValueError("values must be float32 with as many int32 indices")
        index = index.long()
        if (
            values.dim() != 1
            or index.numel() > n
            or (index.numel() and not bool((index[1:] > index[:-1]).all()))
        ):
            raise ValueError("indices must be rising")
        if index.numel() and not (0 <= int(index[0]) and int(index[-1]) < n):
            raise ValueError(f"an index is outside a tensor of {n} values")
        return values.new_zeros(n).index_copy_(0, index, values)

    def _chunk_decode(
        self, n: int, values: torch.Tensor, index: torch.Tensor, *bounds: torch.Tensor
    ) -> torch.Tensor:
        rows, kept = self._rows(n), self._kept(n)
        offsets = unpack(index, self._offset_bits(n), kept)
        if self.bits == 32:
            if values.dtype != torch.float32 or values.shape != (kept,):
                raise ValueError(f"a tensor of {n} values needs {kept} float32 values")
        else:
            if bounds[0].dtype != torch.bfloat16 or bounds[0].shape != (sum(r for r, _ in rows), 2):
                raise ValueError("every chunk needs its two bfloat16 bounds")
            low, high = bounds[0].float().unbind(dim=1)
            if not bool((torch.isfinite(high) & (low >= 0) & (low <= high)).all()):
                raise ValueError("a chunk's bounds must be finite with 0 ≤ low ≤ high")
            codes = unpack(values, self.bits, kept)
        out, at, pos, chunk = torch.zeros(n), 0, 0, 0  # value, kept value and chunk where a row starts
        for r, length in rows:
            k = self.keep(length)
            idx = offsets[pos : pos + r * k].view(r, k)
            if bool((idx >= length).any()) or (k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all())):
                raise ValueError(f"offsets must rise within a chunk of {length} values")
            if self.bits == 32:
                v = values[pos : pos + r * k].view(r, k)
            else:
                v = dequantize(codes[pos : pos + r * k].view(r, k), bounds[0][chunk : chunk + r], self.bits)
            out[at : at + r * length].view(r, length).scatter_(1, idx, v)
            at, pos, chunk = at + r * length, pos + r * k, chunk + r
        return out
