"""The server's write-ahead log: every event that changes the server's state, durable before the
server acts on it or acknowledges it.

A record is a JSON header (the event, with its sequence number `seq`) and an optional payload,
framed as

    [u32 header length][u64 payload length][header][payload][u32 crc32 of header + payload]

and written with one `writev`, made durable with `fdatasync`: at once (`append`), or later by
`sync_to` (group commit: one fdatasync for every record written before it, whoever wrote them).
A pushed outer_grad is not in the record: it is written to a file of its own in `pushes/` next
to the log as its chunks arrive (`Spool`, so the server never holds a whole push in memory),
made durable (fdatasync, outside the server's lock, so pushes arriving together flush
together), and its record names it (`file`, `bytes`). `read` gives such a record's payload as
the file's `Path`; `map_file` reads it in place.

A server killed in the middle of a write leaves a torn last record: `read` stops at the first
record that is incomplete or fails its checksum (that event was never acknowledged) and
`WriteAheadLog` cuts it off before appending. After a checkpoint, `truncate(seq)` drops the
records it covers (rewriting the file and renaming it over the old one, so a crash leaves either
log whole) and their push files. Opening the log deletes push files no whole record names (a
refused push, or one cut off by a crash).

    python -m pytest tests/unit/test_wal.py
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import threading
import uuid
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


def read(path: Path) -> list[tuple[dict[str, Any], bytes | Path]]:
    """Every whole record of the log at `path` (none if it does not exist): (header, payload),
    the payload a push file's path for a record that names one."""
    if not path.exists():
        return []
    return [
        (h, _spool_dir(path) / h["file"] if "file" in h else p) for h, p, _ in _records(path.read_bytes())
    ]


def _spool_dir(path: Path) -> Path:
    return path.parent / "pushes"


def map_file(path: Path) -> mmap.mmap | bytearray:
    """A push file's bytes, mapped copy-on-write: a writable buffer that is read in place
    (core/tensor_view.py) and never written, backed by the page cache, not the heap.
    `release(buf)` drops its pages from the process (they are read again if used)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return bytearray()
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def release(buf: mmap.mmap | bytearray, start: int = 0, end: int | None = None) -> None:
    """The pages of a mapped push file (`map_file`) between byte `start` and `end` (default:
    all) out of this process's memory; they are read again from the page cache if used."""
    if not isinstance(buf, mmap.mmap) or len(buf) == 0:
        return
    end = len(buf) if end is None else min(end, len(buf))
    first = -(-max(0, start) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the range
    last = end if end == len(buf) else end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        buf.madvise(mmap.MADV_DONTNEED, first, last - first)


def release_read(message, tensors: list) -> None:
    """The pages behind `tensors` out of memory once they were read, when they view the mapped
    push file `message` was read from (fp32's do; decoded tensors of other codecs do not)."""
    buf = message.source
    if not isinstance(buf, mmap.mmap) or not len(buf) or not tensors:
        return
    base, size = address(buf), len(buf)
    spans = [(t.data_ptr() - base, t.numel() * t.element_size()) for t in tensors]
    if all(0 <= s < size for s, _ in spans):
        release(buf, min(s for s, _ in spans), max(s + n for s, n in spans))


def address(buf: mmap.mmap | bytearray) -> int:
    """Where `buf`'s bytes start in memory (to find a tensor viewing them)."""
    probe = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


class Spool:
    """A pushed payload written to its own file as it arrives (`WriteAheadLog.spool`)."""

    def __init__(self, directory: Path, stem: str):
        self.name = f"{stem}-{uuid.uuid4().hex[:12]}.msg"
        self.path, self.size, self.kept = directory / self.name, 0, False
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self.size += len(data)

    def finish(self) -> mmap.mmap | bytearray:
        """Durable (the file and its name), closed for writing; its bytes mapped (`map_file`)."""
        os.fdatasync(self._fd)
        os.close(self._fd)
        self._fd = None
        _fsync_dir(self.path.parent)
        return map_file(self.path)

    def discard(self) -> None:
        """Not logged after all (refused, a duplicate, the sender gone): the file goes."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self.kept:
            self.path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteAheadLog:
    """Appends durable records to `path` (cutting off a torn tail left by a crash first)."""

    def __init__(self, path: Path):
        self.path, self.spool_dir = path, _spool_dir(path)
        good, named = 0, set()
        if path.exists():
            for header, _, end in _records(path.read_bytes()):
                good = end
                named.add(header.get("file"))
            with open(path, "r+b") as f:
                f.truncate(good)
        self.spool_dir.mkdir(exist_ok=True)
        for orphan in self.spool_dir.iterdir():  # refused, or cut off by a crash: never logged
            if orphan.name not in named:
                orphan.unlink()
        self._file = open(path, "ab", buffering=0)
        self._written = self._synced = os.fstat(self._file.fileno()).st_size  # bytes written, durable
        self._sync_lock = threading.Lock()

    def spool(self, stem: str) -> Spool:
        """A new push file in `pushes/` (named `stem`-random.msg), for `append(..., spool=)`."""
        return Spool(self.spool_dir, stem)

    def append(
        self, header: dict[str, Any], payload: bytes = b"", spool: Spool | None = None, *, sync: bool = True
    ) -> int:
        """Write one record; with `sync`, make it (and every record before it) durable before
        returning. Without, the caller makes it durable before anyone outside hears of it
        (`sync_to` the returned end, outside the server's lock, or a later synced record).
        `spool`: a push file made durable (`Spool.finish`), which the record names."""
        if spool is not None:
            header = {**header, "file": spool.name, "bytes": spool.size}
        fd, parts = self._file.fileno(), _parts(header, payload)
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = os.writev(fd, parts)
            if written < sum(len(p) for p in parts):  # a short write: finish it
                rest = memoryview(b"".join(parts))[written:]
                while rest:
                    rest = rest[os.write(fd, rest) :]
        except OSError:
            os.ftruncate(fd, start)  # no torn record in the middle of the log (a full disk, ...)
            raise
        end = start + sum(len(p) for p in parts)
        self._written = end
        if spool is not None:
            spool.kept = True
        if sync:
            self.sync_to(end)
        return end

    def sync_to(self, end: int) -> None:
        """Make the log durable up to byte `end` (group commit): one fdatasync covers every
        record written before it, so records appended together, by any thread, share it; a
        caller whose record an earlier fdatasync already covered returns at once."""
        with self._sync_lock:
            if self._synced >= end:
                return
            target = self._written
            os.fdatasync(self._file.fileno())
            self._synced = target

    def truncate(self, seq: int) -> None:
        """Drop the records with `seq` ≤ `seq` (a checkpoint now holds them), and their files."""
        with self._sync_lock:  # no fdatasync of the file being replaced (sync_to waits)
            self._truncate(seq)

    def _truncate(self, seq: int) -> None:
        self._file.close()
        records = [(h, p) for h, p, _ in _records(self.path.read_bytes())]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for h, p in records:
                if h["seq"] > seq:
                    f.write(b"".join(_parts(h, p)))
            f.flush()
            os.fsync(f.fileno())
            tmp_size = f.tell()
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._written = self._synced = tmp_size
        for h, _ in records:  # once no log names them
            if h["seq"] <= seq and "file" in h:
                (self.spool_dir / h["file"]).unlink(missing_ok=True)
        self._file = open(self.path, "ab", buffering=0)

    def close(self) -> None:
        """Every record written made durable, then the file closed."""
        self.sync_to(self._written)
        self._file.close()
