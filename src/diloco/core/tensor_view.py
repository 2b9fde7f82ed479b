"""Tensors read from a safetensors blob without copying them: views into the buffer.

`safetensors.torch.load(bytes)` copies every tensor out of the blob, holding the GIL while it
does: on a server that receives many large pushes at once the copies took turns (40% of the
GIL's time with 16 workers pushing 85 MB each, benchmarks/server_capacity.py). A writable
buffer (a bytearray the push was received into) can instead be read in place: the header is
parsed and checked here as strictly as safetensors does (offsets in order, back to back,
exactly covering the data, sizes matching dtypes and shapes), and each tensor is
`torch.frombuffer` over its bytes.

    tensors, metadata = read_view(bytearray(blob))
"""

from __future__ import annotations

import json
import math

import torch

# safetensors' names of the dtypes a message carries (https://github.com/huggingface/safetensors)
DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.bool: "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


def read_view(buf: bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by name, metadata) of the safetensors blob in `buf`, the tensors sharing its
    memory (keep `buf` unchanged while they are used). ValueError naming what is wrong."""
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("a read-only buffer cannot be read in place")
    if len(view) < 8:
        raise ValueError(f"{len(view)} bytes, shorter than a header")
    n = int.from_bytes(view[:8], "little")
    if n > len(view) - 8:
        raise ValueError(f"its header claims {n} bytes of {len(view) - 8}")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except ValueError as e:
        raise ValueError(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    data = view[8 + n :]
    entries = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = _BY_NAME[entry["dtype"]], entry["shape"], entry["data_offsets"]
            ok = (
                all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(begin, int)
                and isinstance(end, int)
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has a malformed entry") from None
        if not ok:
            raise ValueError(f"tensor {name!r} has a malformed shape or offsets")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != size:
            raise ValueError(f"tensor {name!r} has {end - begin} bytes for {size}")
        entries.append((begin, end, name, dtype, shape))
    entries.sort()
    at = 0
    for begin, end, name, _, _ in entries:  # back to back, from 0 to the end of the data
        if begin != at:
            raise ValueError(f"tensor {name!r} starts at {begin}, not {at}")
        at = end
    if at != len(data):
        raise ValueError(f"its tensors cover {at} bytes of {len(data)}")
    tensors = {}
    for begin, end, name, dtype, shape in entries:
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
    return tensors, {str(k): str(v) for k, v in metadata.items()}
