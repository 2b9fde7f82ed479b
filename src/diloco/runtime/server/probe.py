"""Link probes: what `diloco plan --probe-link HOST:PORT` measures a link to a running server
with (run/link.py's `probe_link`). ProbeDown streams `nbytes` of zeros down in chunks (0: an
empty stream, one round trip); ProbeUp counts what comes up and answers with the count. Both
carry at most PROBE_MAX_BYTES, need the run's token like every call, and touch nothing of the
run's state.

    diloco plan --probe-link server.example:7000 --token-file token --step-s 0.3
"""

from __future__ import annotations

import grpc

from diloco.runtime.server import diloco_pb2 as pb
from diloco.runtime.server.wire import CHUNK_BYTES, PROBE_MAX_BYTES

_ZEROS = bytes(CHUNK_BYTES)


class ProbeHandlers:
    """The probe calls of the ParameterServer service (a part of runtime/server/handlers.py)."""

    def ProbeDown(self, request, ctx):
        n = request.nbytes
        if not 0 <= n <= PROBE_MAX_BYTES:
            ctx.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"a probe of {n} bytes; ask for 0 to {PROBE_MAX_BYTES}"
            )
        for at in range(0, n, CHUNK_BYTES):
            size = min(CHUNK_BYTES, n - at)
            yield pb.ProbeChunk(data=_ZEROS if size == CHUNK_BYTES else _ZEROS[:size])

    def ProbeUp(self, request_iterator, ctx):
        total = 0
        for chunk in request_iterator:
            total += len(chunk.data)
            if total > PROBE_MAX_BYTES:
                ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a probe of more than {PROBE_MAX_BYTES} bytes")
        return pb.ProbeReply(nbytes=total)
