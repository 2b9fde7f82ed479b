"""What the server and its workers (run/worker.py) must agree on beyond diloco.proto: the
protocol's version, the size of a stream's chunks, how a push is cut into them, and how a
message is streamed without being made into one blob first (`message_stream`).

    from diloco.runtime.server.wire import CHUNK_BYTES, PROTOCOL, message_stream, push_chunks
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch

from diloco.core.codec import Encoded
from diloco.core.tensor_view import DTYPES
from diloco.runtime.server import diloco_pb2 as pb

# bumped when the messages change meaning (4: the config sent to workers says "async", not
# "server"; 5: a job carries lr_stride, sync DiLoCo with DyLU, and seconds, a deadline job; 6: a
# worker may be a torchrun group, which says its ranks and launch when it registers; 7: a worker
# says the digest of the parameters it built, and a job of those comes without them, `own`)
PROTOCOL = 7
CHUNK_BYTES = 1 << 20  # a stream's chunks stay well under gRPC's 4 MB message limit
PROBE_MAX_BYTES = 64 << 20  # the most one link probe (ProbeDown, ProbeUp) may carry


def push_chunks(head: pb.PushChunk, blob: bytes) -> Iterator[pb.PushChunk]:
    """A push's stream: the header (`head`) carrying the first chunk of `blob`, then the rest."""
    head.data = blob[:CHUNK_BYTES]
    yield head
    for at in range(CHUNK_BYTES, len(blob), CHUNK_BYTES):
        yield pb.PushChunk(data=blob[at : at + CHUNK_BYTES])


def message_stream(message: Encoded) -> tuple[int, Iterator[bytes]]:
    """`message` as the bytes `Encoded.to_bytes` would make (a safetensors blob that
    `Encoded.from_bytes` reads back), in pieces of at most CHUNK_BYTES cut straight from the
    tensors' memory: the whole blob never exists, so a model's θ is held once however many
    workers download it. Returns (its length, the pieces)."""
    tensors = [t.detach().cpu().contiguous() for t in message.payload]
    if any(t.dtype not in DTYPES for t in tensors):  # not a dtype a message has today
        blob = message.to_bytes()
        return len(blob), (blob[at : at + CHUNK_BYTES] for at in range(0, len(blob), CHUNK_BYTES))
    header: dict = {
        "__metadata__": {
            "codec": message.codec,
            "nbytes": str(message.nbytes),
            "meta": json.dumps(message.meta),
        }
    }
    at = 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        header[f"{i:05d}"] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-aligned, as safetensors writes it
    first = len(head).to_bytes(8, "little") + head

    def pieces() -> Iterator[bytes]:
        buffer = bytearray(first)
        for t in tensors:
            if t.numel() == 0:
                continue
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            while view:
                if not buffer and len(view) >= CHUNK_BYTES:  # a whole chunk of this tensor: one copy
                    yield bytes(view[:CHUNK_BYTES])
                    view = view[CHUNK_BYTES:]
                    continue
                take = CHUNK_BYTES - len(buffer)
                buffer += view[:take]
                view = view[take:]
                if len(buffer) == CHUNK_BYTES:
                    yield bytes(buffer)
                    buffer = bytearray()
        if buffer:
            yield bytes(buffer)

    return len(first) + at, pieces()
