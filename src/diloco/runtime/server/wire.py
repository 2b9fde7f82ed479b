"""What the server and its workers (run/worker.py) must agree on beyond diloco.proto: the
protocol's version and the size of a stream's chunks.

    from diloco.runtime.server.wire import CHUNK_BYTES, PROTOCOL
"""

from __future__ import annotations

PROTOCOL = (
    4  # bumped when the messages change meaning (4: the config sent to workers says "async", not "server")
)
CHUNK_BYTES = 1 << 20  # a stream's chunks stay well under gRPC's 4 MB message limit
