"""A safetensors blob read in place (core/tensor_view.py, how the server reads a push) gives the
tensors safetensors itself reads, sharing the buffer's memory; damaged blobs are refused as
safetensors refuses them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load

from diloco.core.codec import Encoded, build_codec
from diloco.core.tensor_view import read_view
from diloco.errors import UserError


def blob(codec: str = "fp4") -> bytes:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 7, generator=g), torch.randn(5, generator=g), torch.randn(()), torch.zeros(0)]
    return build_codec(codec, topk_fraction=0.2).encode(tensors, {}).to_bytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "fp4", "topk"])
def test_read_in_place_equals_safetensors(codec):
    b = blob(codec)
    buf = bytearray(b)
    tensors, metadata = read_view(buf)
    want = st_load(b)
    assert sorted(tensors) == sorted(want)
    for name, t in want.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t)
    a, c = Encoded.from_bytes(buf), Encoded.from_bytes(b)
    assert a.digest() == c.digest() and metadata["codec"] == c.codec
    # in place: every tensor is a view of the buffer, so flipping the data's bits changes them all
    before = {k: t.clone() for k, t in tensors.items()}
    start = 8 + int.from_bytes(buf[:8], "little")
    buf[start:] = bytes(x ^ 0xFF for x in buf[start:])
    for k, t in tensors.items():
        if t.numel():
            assert not torch.equal(t.view(-1).view(torch.uint8), before[k].view(-1).view(torch.uint8)), k


def damaged() -> list[tuple[str, bytearray]]:
    b = blob()
    n = int.from_bytes(b[:8], "little")
    header = json.loads(b[8 : 8 + n])
    out = [("truncated", bytearray(b[:-3])), ("short", bytearray(b[:5]))]
    out.append(("header length", bytearray((10**9).to_bytes(8, "little") + b[8:])))
    out.append(("not JSON", bytearray(b[:8] + b"{" * n + b[8 + n :])))

    def edited(what: str, change) -> tuple[str, bytearray]:
        h = json.loads(json.dumps(header))
        change(h)
        text = json.dumps(h).encode()
        text += b" " * (-len(text) % 8)
        return what, bytearray(len(text).to_bytes(8, "little") + text + b[8 + n :])

    first = next(k for k in header if k != "__metadata__")
    out.append(edited("dtype", lambda h: h[first].update(dtype="Q7")))
    shape, (_, end) = header[first]["shape"], header[first]["data_offsets"]
    out.append(edited("size", lambda h: h[first].update(shape=[shape[0] + 1, *shape[1:]])))
    out.append(edited("offsets", lambda h: h[first].update(data_offsets=[1, end + 1])))
    out.append(edited("shape", lambda h: h[first].update(shape=[-1])))
    out.append(("extra", bytearray(b + b"\0\0\0\0")))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what,buf", damaged(), ids=[w for w, _ in damaged()])
def test_a_damaged_blob_is_refused_with_a_sentence(what, buf):
    with pytest.raises(ValueError):
        read_view(buf)
    with pytest.raises(UserError, match="not a valid encoded message"):
        Encoded.from_bytes(buf)
    try:  # safetensors refuses it too
        st_load(bytes(buf))
    except Exception:  # its own error types
        pass
    else:
        raise AssertionError("safetensors read it")
