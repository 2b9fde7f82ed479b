"""An encoded message: a codec's payload tensors, its size in bytes, and how it becomes bytes on
the wire and back (a safetensors blob with the codec's name in its metadata). The codecs that make
and read them are in codec.py.

    python -c "import torch; from diloco.core.encoded import Encoded; \
print(Encoded.from_bytes(Encoded('fp32', [torch.ones(3)], 12).to_bytes()).nbytes)"
"""

from __future__ import annotations

import hashlib
import json
import mmap
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.numpy import save as np_save
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco.core.tensor_view import read_view
from diloco.errors import UserError

# dtypes safetensors' numpy writer takes as they are (bfloat16, for one, it does not)
_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


@dataclass
class Encoded:
    """An encoded list of tensors: what crosses the network, and its size in bytes."""

    codec: str
    payload: list[torch.Tensor]
    nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)  # small JSON-able extras a codec needs
    source: Any = field(default=None, repr=False, compare=False)  # the buffer it was read in place from

    def to_bytes(self) -> bytes:
        tensors = {f"{i:05d}": t.detach().cpu().contiguous() for i, t in enumerate(self.payload)}
        header = {"codec": self.codec, "nbytes": str(self.nbytes), "meta": json.dumps(self.meta)}
        if all(t.dtype in _NUMPY_DTYPES for t in tensors.values()):  # the same bytes, 1.5x faster
            return np_save({k: t.numpy() for k, t in tensors.items()}, metadata=header)
        return st_save(tensors, metadata=header)

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | mmap.mmap) -> Encoded:
        """The message in `blob`; a damaged or foreign blob is a UserError naming the problem.
        A bytearray or a mapped file is read in place (core/tensor_view.py): the tensors share
        its memory."""
        try:
            if isinstance(blob, (bytearray, mmap.mmap)):
                tensors, header = read_view(blob)
            else:
                tensors = st_load(blob)
                header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
            return cls(
                header["codec"],
                [tensors[k] for k in sorted(tensors)],
                int(header["nbytes"]),
                json.loads(header["meta"]),
                blob if isinstance(blob, (bytearray, mmap.mmap)) else None,
            )
        except Exception as e:  # safetensors raises its own error types; any of them means the same
            raise UserError(
                f"an outer_grad message is not a valid encoded message ({e}); resend it."
            ) from None

    def digest(self) -> str:
        """A hash of the message's values (not of `to_bytes`, whose safetensors header order may
        differ between processes): equal digests, equal messages."""
        h = hashlib.sha256(json.dumps([self.codec, self.nbytes, self.meta], sort_keys=True).encode())
        for t in self.payload:
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec, "payload": self.payload, "nbytes": self.nbytes, "meta": self.meta}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Encoded:
        return cls(state["codec"], list(state["payload"]), int(state["nbytes"]), dict(state["meta"]))
