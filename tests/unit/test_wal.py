"""The write-ahead log: records come back whole and in order; a torn or damaged tail is cut."""

from __future__ import annotations

import os
import threading

import pytest

from diloco.runtime.server import wal


@pytest.mark.timeout(30)
def test_records_round_trip_in_order(tmp_path):
    log = wal.WriteAheadLog(tmp_path / "wal.log")
    log.append({"seq": 1, "kind": "join"})
    log.append({"seq": 2, "kind": "push"}, b"\x00\x01payload")
    log.close()
    assert wal.read(tmp_path / "wal.log") == [
        ({"seq": 1, "kind": "join"}, b""),
        ({"seq": 2, "kind": "push"}, b"\x00\x01payload"),
    ]


@pytest.mark.timeout(30)
def test_a_torn_tail_is_ignored_then_cut_before_appending(tmp_path):
    path = tmp_path / "wal.log"
    log = wal.WriteAheadLog(path)
    log.append({"seq": 1}, b"a" * 100)
    log.append({"seq": 2}, b"b" * 100)
    log.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # killed in the middle of writing record 2
    assert [h["seq"] for h, _ in wal.read(path)] == [1]
    log = wal.WriteAheadLog(path)
    log.append({"seq": 2}, b"c")
    log.close()
    assert [(h["seq"], p[:1]) for h, p in wal.read(path)] == [(1, b"a"), (2, b"c")]


@pytest.mark.timeout(30)
def test_a_damaged_record_ends_the_log(tmp_path):
    path = tmp_path / "wal.log"
    log = wal.WriteAheadLog(path)
    for seq in (1, 2, 3):
        log.append({"seq": seq}, bytes([seq]) * 50)
    log.close()
    blob = bytearray(path.read_bytes())
    second = blob.index(bytes([2]) * 50)
    blob[second + 10] ^= 0xFF  # a flipped bit in record 2's payload: its checksum fails
    path.write_bytes(bytes(blob))
    assert [h["seq"] for h, _ in wal.read(path)] == [1]


@pytest.mark.timeout(30)
def test_truncate_keeps_only_records_after_the_checkpoint(tmp_path):
    log = wal.WriteAheadLog(tmp_path / "wal.log")
    for seq in range(1, 6):
        log.append({"seq": seq}, b"x")
    log.truncate(3)
    log.append({"seq": 6})
    log.close()
    assert [h["seq"] for h, _ in wal.read(tmp_path / "wal.log")] == [4, 5, 6]


@pytest.mark.timeout(30)
def test_a_push_file_is_named_by_its_record_read_in_place_and_dropped_with_it(tmp_path):
    path = tmp_path / "wal.log"
    log = wal.WriteAheadLog(path)
    spool = log.spool("job7")
    for piece in (b"abc", b"", b"defg"):  # as its chunks arrive
        spool.write(piece)
    buf = spool.finish()
    assert bytes(buf) == b"abcdefg" and not memoryview(buf).readonly  # read in place (tensor_view)
    wal.release(buf)
    assert bytes(buf) == b"abcdefg"  # its pages are read again when used
    log.append({"seq": 1, "kind": "push"}, spool=spool)
    spool.discard()  # logged: kept
    log.append({"seq": 2, "kind": "apply"})
    (header, payload), second = wal.read(path)
    assert header == {"seq": 1, "kind": "push", "file": spool.name, "bytes": 7}
    assert payload == tmp_path / "pushes" / spool.name and payload.read_bytes() == b"abcdefg"
    assert second == ({"seq": 2, "kind": "apply"}, b"")
    log.truncate(1)  # a checkpoint holds event 1: its record and its file go
    assert not payload.exists() and [h["seq"] for h, _ in wal.read(path)] == [2]
    log.close()


@pytest.mark.timeout(30)
def test_push_files_no_record_names_are_deleted_when_the_log_opens(tmp_path):
    path = tmp_path / "wal.log"
    log = wal.WriteAheadLog(path)
    kept, refused, cut_off = log.spool("a"), log.spool("b"), log.spool("c")
    for s in (kept, refused, cut_off):
        s.write(b"x" * 10)
    kept.finish()
    log.append({"seq": 1, "kind": "push"}, spool=kept)
    refused.discard()  # refused: gone at once
    assert not refused.path.exists() and cut_off.path.exists()  # cut_off: the server died here
    log.close()
    wal.WriteAheadLog(path).close()
    assert sorted(p.name for p in (tmp_path / "pushes").iterdir()) == [kept.name]


def _resident_kb(path) -> int:
    """Resident kB of this process's mapping of `path` (/proc/self/smaps)."""
    lines, kb, inside = open("/proc/self/smaps").read().splitlines(), 0, False
    for line in lines:
        if line[:1].isdigit() or line[:1] in "abcdef":
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            kb += int(line.split()[1])
    return kb


@pytest.mark.timeout(30)
def test_released_pages_of_a_push_file_leave_the_process_and_read_back_the_same(tmp_path):
    log = wal.WriteAheadLog(tmp_path / "wal.log")
    spool = log.spool("big")
    data = bytes(range(256)) * (8 << 12)  # 8 MB
    spool.write(data)
    buf = spool.finish()
    assert bytes(buf) == data and _resident_kb(spool.path) >= 8 << 10  # read: resident
    wal.release(buf, 0, 4 << 20)  # the first half, as a check does group by group
    assert 4 << 10 <= _resident_kb(spool.path) < (4 << 10) + 8
    wal.release(buf)
    assert _resident_kb(spool.path) == 0
    assert bytes(buf) == data  # read again from the page cache
    log.close()


@pytest.mark.timeout(30)
def test_records_appended_together_share_one_fdatasync(tmp_path, monkeypatch):
    log = wal.WriteAheadLog(tmp_path / "wal.log")
    synced, real = [], os.fdatasync
    monkeypatch.setattr(wal.os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    first = log.append({"seq": 1, "kind": "push"}, sync=False)
    second = log.append({"seq": 2, "kind": "apply"}, sync=False)
    assert synced == [] and first < second
    log.sync_to(first)  # one fdatasync covers every record written so far
    log.sync_to(second)
    assert len(synced) == 1
    log.append({"seq": 3, "kind": "dispatch"})  # synced at once
    assert len(synced) == 2
    log.truncate(1)  # rewritten and fsynced whole: an end from before it needs nothing more
    log.sync_to(second)
    log.append({"seq": 4, "kind": "apply"}, sync=False)
    log.close()  # what is written is made durable before the file closes
    assert len(synced) == 3
    assert [h["seq"] for h, _ in wal.read(tmp_path / "wal.log")] == [2, 3, 4]


@pytest.mark.timeout(30)
def test_threads_syncing_at_once_share_fdatasyncs_and_each_returns_durable(tmp_path, monkeypatch):
    log = wal.WriteAheadLog(tmp_path / "wal.log")
    synced, real, lock = [], os.fdatasync, threading.Lock()
    monkeypatch.setattr(wal.os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    ends = []

    def push(i: int) -> None:
        with lock:  # the server's lock: records are appended one at a time, in order
            end = log.append({"seq": i, "kind": "push"}, b"x" * 1000, sync=False)
        log.sync_to(end)  # outside it, as a push handler does
        ends.append(end)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(1, 17)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ends) == 16 and 1 <= len(synced) <= 16
    assert log._synced >= max(ends)  # every caller's record is durable once it returned
    log.close()
    assert sorted(h["seq"] for h, _ in wal.read(tmp_path / "wal.log")) == list(range(1, 17))
