"""The replay log: an append-only record of stored and consumed groups, on disk.

With `--replay.log-dir`, every group is appended before it is acknowledged, and
every consumed batch shard is appended as a list of group ids when the learner
acknowledges it. After a crash (even SIGKILL) a new replay process on the same
directory replays the log: every acknowledged-but-unconsumed group is back, in
order, and no consumed group is served again.

Layout: segment files `00000001.seg`, `00000002.seg`, ... each a sequence of
records `[u32 length][u32 crc32][u32 meta length][msgpack meta][raw bytes]`
(the raw bytes are a stored group's blob, written as it arrived; the crc covers
everything after itself). A new segment starts when the
current one passes `segment_bytes`. Segments are removed oldest first, once
every group they hold is consumed: consumed markers only ever point backwards,
so removing a prefix never forgets a marker that a live segment needs. A torn
record at the end of the last segment (a crash mid-write) is cut off.

fsync policy: "always" (fsync before every acknowledgement: survives power
loss), "interval" (at most every `fsync_interval_s`: survives a process crash,
as the OS has the bytes), "never" (leave it to the OS).
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import msgpack

_HEADER = struct.Struct("<II")
_META = struct.Struct("<I")
FSYNC_POLICIES = ("always", "interval", "never")


class ReplayLog:
    def __init__(self, directory: str | os.PathLike, fsync: str = "interval", fsync_interval_s: float = 1.0,
                 segment_bytes: int = 256 << 20) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"--replay.fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync, self.fsync_interval_s, self.segment_bytes = fsync, fsync_interval_s, segment_bytes
        self._live: OrderedDict[int, set[str]] = OrderedDict()  # segment -> unconsumed group ids in it
        self._where: dict[str, int] = {}
        self._file = None
        self._segment = 0
        self._last_sync = time.monotonic()

    # -- recovery -------------------------------------------------------------
    def recover(self) -> tuple[list[bytes], list[str]]:
        """Read the log: (unconsumed group blobs in arrival order, the ids of every group stored
        in the log's segments, in order)."""
        stored: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        seen: dict[str, None] = {}
        segments = sorted(int(p.stem) for p in self.dir.glob("*.seg"))
        for seg in segments:
            for body in self._records(seg, last=seg == segments[-1]):
                (meta_len,) = _META.unpack_from(body)
                rec = msgpack.unpackb(body[_META.size:_META.size + meta_len], raw=False)
                if rec["k"] == "g":
                    seen[rec["id"]] = None
                    stored[rec["id"]] = (body[_META.size + meta_len:], seg)
                else:
                    for gid in rec["ids"]:
                        stored.pop(gid, None)
        for gid, (_, seg) in stored.items():
            self._live.setdefault(seg, set()).add(gid)
            self._where[gid] = seg
        for seg in segments:
            self._live.setdefault(seg, set())
        self._live = OrderedDict(sorted(self._live.items()))
        self._segment = segments[-1] if segments else 0
        self._roll()
        self._collect()
        return [blob for blob, _ in stored.values()], list(seen)

    def _records(self, seg: int, last: bool):
        path = self._path(seg)
        data = path.read_bytes()
        pos = 0
        while pos + _HEADER.size <= len(data):
            n, crc = _HEADER.unpack_from(data, pos)
            body = data[pos + _HEADER.size: pos + _HEADER.size + n]
            if len(body) < n or zlib.crc32(body) != crc:
                break
            yield body
            pos += _HEADER.size + n
        if pos < len(data):
            if not last:
                raise RuntimeError(f"replay log segment {path} is corrupt at byte {pos}")
            with open(path, "r+b") as f:  # a torn write at the tail: cut it off
                f.truncate(pos)

    # -- appending -------------------------------------------------------------
    def _path(self, seg: int) -> Path:
        return self.dir / f"{seg:08d}.seg"

    def _roll(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        self._segment += 1
        self._file = open(self._path(self._segment), "ab")
        self._live[self._segment] = set()

    def _append(self, rec: dict, raw=b"") -> None:
        meta = msgpack.packb(rec, use_bin_type=True)
        head = _META.pack(len(meta)) + meta
        raw = memoryview(raw).cast("B")
        self._file.write(_HEADER.pack(len(head) + len(raw), zlib.crc32(raw, zlib.crc32(head))))
        self._file.write(head)
        self._file.write(raw)  # the blob as it arrived: no copy into a msgpack body

    def _sync(self, force: bool = False) -> None:
        self._file.flush()  # to the OS on every record: a killed process loses nothing
        now = time.monotonic()
        if force or self.fsync == "always" or (
                self.fsync == "interval" and now - self._last_sync >= self.fsync_interval_s):
            os.fsync(self._file.fileno())
            self._last_sync = now

    def stored(self, group_id: str, blob) -> None:
        """Record a stored group; durable per the fsync policy when this returns."""
        self._append({"k": "g", "id": group_id}, blob)
        self._live[self._segment].add(group_id)
        self._where[group_id] = self._segment
        self._sync()
        if self._file.tell() >= self.segment_bytes:
            self._roll()

    def consumed(self, group_ids: list[str]) -> None:
        """Record groups the learner has trained on; drop segments that hold nothing live."""
        self._append({"k": "c", "ids": list(group_ids)})
        for gid in group_ids:
            seg = self._where.pop(gid, None)
            if seg is not None:
                self._live[seg].discard(gid)
        self._sync()
        self._collect()

    def _collect(self) -> None:
        while len(self._live) > 1:
            seg, ids = next(iter(self._live.items()))
            if ids or seg == self._segment:
                break
            self._live.popitem(last=False)
            self._path(seg).unlink(missing_ok=True)

    def segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.dir.glob("*.seg"))

    def close(self) -> None:
        if self._file is not None:
            self._sync(force=True)
            self._file.close()
            self._file = None
