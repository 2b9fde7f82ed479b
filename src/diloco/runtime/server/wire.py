"""What the server and its workers (run/worker.py) must agree on beyond diloco.proto: the
protocol's version, the size of a stream's chunks, and how a push is cut into them.

    from diloco.runtime.server.wire import CHUNK_BYTES, PROTOCOL, push_chunks
"""

from __future__ import annotations

from collections.abc import Iterator

from diloco.runtime.server import diloco_pb2 as pb

# bumped when the messages change meaning (4: the config sent to workers says "async", not
# "server"; 5: a job carries lr_stride, sync DiLoCo with DyLU, and seconds, a deadline job; 6: a
# worker may be a torchrun group, which says its ranks and launch when it registers; 7: a worker
# says the digest of the parameters it built, and a job of those comes without them, `own`)
PROTOCOL = 7
CHUNK_BYTES = 1 << 20  # a stream's chunks stay well under gRPC's 4 MB message limit


def push_chunks(head: pb.PushChunk, blob: bytes) -> Iterator[pb.PushChunk]:
    """A push's stream: the header (`head`) carrying the first chunk of `blob`, then the rest."""
    head.data = blob[:CHUNK_BYTES]
    yield head
    for at in range(CHUNK_BYTES, len(blob), CHUNK_BYTES):
        yield pb.PushChunk(data=blob[at : at + CHUNK_BYTES])
