"""The server's write-ahead log: every event that changes the server's state, durable before the
server acts on it or acknowledges it.

A record is a JSON header (the event, with its sequence number `seq`) and an optional payload
(an outer_grad message's bytes), framed as

    [u32 header length][u64 payload length][header][payload][u32 crc32 of header + payload]

and written with one `writev` and `fdatasync`. A server killed in the middle of a write
leaves a torn last record: `read` stops at the first record that is incomplete or fails its
checksum (that event was never acknowledged) and `WriteAheadLog` cuts it off before appending.
After a checkpoint, `truncate(seq)` drops the records it covers (rewriting the file and
renaming it over the old one, so a crash leaves either log whole).

    python -m pytest tests/unit/test_wal.py
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_FRAME = struct.Struct("<IQ")
_CRC = struct.Struct("<I")


def _parts(header: dict[str, Any], payload: bytes) -> list[bytes]:
    """One record as the pieces written one after the other (no copy of the payload)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    crc = zlib.crc32(payload, zlib.crc32(head))
    return [_FRAME.pack(len(head), len(payload)), head, payload, _CRC.pack(crc)]


def _records(blob: bytes) -> Iterator[tuple[dict[str, Any], bytes, int]]:
    """(header, payload, end offset) of each whole record in `blob`, up to the first bad one."""
    at = 0
    while at + _FRAME.size <= len(blob):
        nhead, npay = _FRAME.unpack_from(blob, at)
        end = at + _FRAME.size + nhead + npay + _CRC.size
        if end > len(blob):
            return
        head = blob[at + _FRAME.size : at + _FRAME.size + nhead]
        payload = blob[at + _FRAME.size + nhead : end - _CRC.size]
        if _CRC.unpack_from(blob, end - _CRC.size)[0] != zlib.crc32(payload, zlib.crc32(head)):
            return
        try:
            header = json.loads(head)
        except ValueError:
            return
        yield header, payload, end
        at = end


def read(path: Path) -> list[tuple[dict[str, Any], bytes]]:
    """Every whole record of the log at `path` (none if it does not exist)."""
    if not path.exists():
        return []
    return [(h, p) for h, p, _ in _records(path.read_bytes())]


class WriteAheadLog:
    """Appends durable records to `path` (cutting off a torn tail left by a crash first)."""

    def __init__(self, path: Path):
        self.path = path
        good = 0
        if path.exists():
            for _, _, end in _records(path.read_bytes()):
                good = end
            with open(path, "r+b") as f:
                f.truncate(good)
        self._file = open(path, "ab", buffering=0)

    def append(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """Write one record and make it durable (fdatasync) before returning."""
        fd, parts = self._file.fileno(), _parts(header, payload)
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = os.writev(fd, parts)
            if written < sum(len(p) for p in parts):  # a short write: finish it
                rest = memoryview(b"".join(parts))[written:]
                while rest:
                    rest = rest[os.write(fd, rest) :]
            os.fdatasync(fd)
        except OSError:
            os.ftruncate(fd, start)  # no torn record in the middle of the log (a full disk, ...)
            raise

    def truncate(self, seq: int) -> None:
        """Drop the records with `seq` ≤ `seq` (a checkpoint now holds them)."""
        self._file.close()
        keep = [(h, p) for h, p in read(self.path) if h["seq"] > seq]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for h, p in keep:
                f.write(b"".join(_parts(h, p)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._file = open(self.path, "ab", buffering=0)

    def close(self) -> None:
        self._file.close()
