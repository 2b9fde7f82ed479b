"""A message streamed from its tensors' memory (wire.message_stream, how the server sends θ)
reads back as the same message, in chunks of exactly CHUNK_BYTES but the last."""

from __future__ import annotations

import pytest
import torch

from diloco.core.codec import Encoded, build_codec
from diloco.runtime.server.wire import CHUNK_BYTES, message_stream


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "fp4", "topk"])
def test_a_streamed_message_reads_back_the_same(codec):
    g = torch.Generator().manual_seed(0)
    # 3.2 MB of float32 over several tensors, a 0-dim one and an empty one
    tensors = [torch.randn(600, 1000, generator=g), torch.randn(77, generator=g), torch.randn(())]
    tensors += [torch.zeros(0), torch.randn(200, 1000, generator=g)]
    message = build_codec(codec, topk_fraction=0.1).encode(tensors, {})
    total, pieces = message_stream(message)
    pieces = list(pieces)
    blob = b"".join(pieces)
    assert total == len(blob)
    assert all(len(p) == CHUNK_BYTES for p in pieces[:-1]) and 0 < len(pieces[-1]) <= CHUNK_BYTES
    back = Encoded.from_bytes(blob)
    assert (back.codec, back.nbytes, back.meta) == (message.codec, message.nbytes, message.meta)
    assert len(back.payload) == len(message.payload)
    for a, b in zip(back.payload, message.payload, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert back.digest() == message.digest()
    if codec == "fp32":  # the same bytes as to_bytes, up to the order of the header's fields
        assert len(blob) - len(message.to_bytes()) in range(-8, 9)
