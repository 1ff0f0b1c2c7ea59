"""The replay log: an append-only record of stored, assigned and consumed groups, on disk.

With `--replay.log-dir`, every group is appended before it is acknowledged;
every batch, before any shard of it is served, is appended as its assignment
(the step, and the group ids of each rank's shard); a shard is appended as
consumed (its group ids) when its rank acknowledges it, and as released when
its rank asks for a later step without acknowledging it. After a crash (even
SIGKILL) a new replay process on the same directory replays the log: every
acknowledged-but-unconsumed group is back, in order; every shard still assigned
is back with its rank, holding the same groups; no consumed group is served
again. `history(directory)` reads the same records without touching them, for
audits.

Layout: segment files `00000001.seg`, `00000002.seg`, ... Each starts with a
4 KiB block holding the format's magic, then records, each starting on a 4 KiB
boundary: a head `[u32 meta length][u32 raw length][u64 checksum][msgpack meta]`
zero-padded to whole blocks, then the raw bytes (a stored group's blob, as it
arrived) zero-padded to whole blocks. The checksum (`checksum`) runs over the
raw bytes' blocks, then the lengths and the meta. The meta is one of

    {"k": "g", "id": group id}                      a stored group (its blob is the raw bytes)
    {"k": "a", "step": s, "shards": [[ids], ...]}   step s's batch, one list of ids per rank
    {"k": "c", "ids": [ids]}                        consumed (trained on, or dropped as stale)
    {"k": "r", "step": s, "rank": r}                rank r's shard of step s went back to the queue

A shard stays assigned until a release names it or all its groups are
consumed; a later assignment of the same step replaces an earlier one. A new
segment starts when the current one passes `segment_bytes`. Segments are
removed oldest first, once every group they hold is consumed: every record
points only backwards (a marker or an assignment to groups stored before it, a
release to an assignment before it), so removing a prefix never forgets a
record that a live segment needs: an assignment whose segment goes had all its
groups consumed. A torn record at the end of the last segment (a crash
mid-write) is cut off, and everything written after it with it: what recovery
sees is always a prefix of what was appended.

Writes: records are queued and written together, with as few `pwritev` calls as
the kernel takes, whenever the log syncs. Where the filesystem allows it, segments are
opened with O_DIRECT: the blob goes from the memory it arrived in (a ZeroMQ
frame, copied once into an aligned buffer, or an actor's page-aligned arena,
not copied at all) to the device, without a copy into the page cache; the
process is not left holding a dirty gigabyte for the next fsync. Elsewhere
(tmpfs, some network filesystems) the same layout is written through the page
cache.

fsync policy: "always" (fsync before every acknowledgement: survives power
loss), "interval" (at most every `fsync_interval_s`: survives a process crash,
as the OS or the device has the bytes), "never" (leave it to the OS).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import msgpack
import numpy as np


BLOCK = 4096
MAGIC = b"TANDEM-REPLAY-LOG-4\n"
_HEAD = struct.Struct("<IIQ")  # meta length, raw length, checksum
_WORDS = BLOCK // 8
_KEY = np.uint64(0x9E3779B97F4A7C15)  # odd: 2^64 / golden ratio
_MAX_META = 64 << 20
Fsync = Literal["always", "interval", "never"]
FSYNC_POLICIES = get_args(Fsync)


def blocks(n: int) -> int:
    """`n` rounded up to whole blocks."""
    return (n + BLOCK - 1) // BLOCK * BLOCK


def checksum(data, first: int = 0) -> int:
    """A 64-bit checksum of `data` cut into 4 KiB blocks, the last one zero-padded:

        S_b = Σ_j w_bj  mod 2^64            (w_bj: block b's little-endian 64-bit words)
        k_b = (b + first + 1) · 0x9E3779B97F4A7C15 | 1      (odd)
        h   = Σ_b k_b · S_b  mod 2^64

    What the log must catch is a torn write: a crash leaves some blocks of a record unwritten
    (zeros) or holding older bytes. k_b is odd, so k_b · ΔS_b = 0 mod 2^64 only when ΔS_b = 0:
    a single flipped bit anywhere always changes h, and so does one block replaced by other
    bytes, unless they have the very same word sum mod 2^64. Changes to several blocks cancel
    only by coincidence. (zlib's crc32 guarantees no more for records of this size: beyond
    11 KiB it too catches every 1-bit error, not every 2-bit one.)
    It is vectorised numpy additions: ~28 µs for a 416 KiB group against ~100 µs for
    zlib.crc32 (zlib 1.2.13, which has no SIMD path), on the CPU the replay bench runs on."""
    view = memoryview(data).cast("B")
    full, rest = divmod(len(view), BLOCK)
    sums = np.empty(full + (rest > 0), np.uint64)
    if full:
        np.frombuffer(view, np.uint64, count=full * _WORDS).reshape(full, _WORDS).sum(axis=1, out=sums[:full])
    if rest:
        tail = bytearray(BLOCK)
        tail[:rest] = view[full * BLOCK:]
        sums[full] = np.frombuffer(tail, np.uint64).sum()
    keys = np.arange(first + 1, first + 1 + len(sums), dtype=np.uint64) * _KEY | np.uint64(1)
    return int((sums * keys).sum())


def _digest(meta, raw, raw_sum: int | None = None) -> int:
    """The checksum of a record: its raw bytes' blocks (`raw_sum`, when the caller has it
    already), then its lengths and meta's."""
    lengths = struct.pack("<II", len(meta), len(raw))  # so that a wrong length cannot pass for zero padding
    raw_sum = checksum(raw) if raw_sum is None else raw_sum
    return (raw_sum + checksum(lengths + meta, first=blocks(len(raw)) // BLOCK)) & 0xFFFF_FFFF_FFFF_FFFF


def _pwrite(fd: int, path: Path, parts: list, offset: int, scratch, spare: list) -> None:
    while parts:
        chunk, parts = parts[:512], parts[512:]
        total = sum(len(p) for p in chunk)
        written = os.pwritev(fd, chunk, offset)
        if written != total:
            raise OSError(f"replay log: short write ({written} of {total} bytes) to {path}")
        offset += total
    spare.append(scratch)  # list.append is atomic: the writing thread may take it back


def _fsync_close(fd: int) -> None:
    os.fsync(fd)
    os.close(fd)


def _address(buf) -> int:
    return np.frombuffer(buf, np.uint8).ctypes.data if len(buf) else 0


@dataclass
class Recovered:
    """What a log holds for a new replay process."""

    groups: list[tuple[str, bytes]]
    """(group id, blob) of every unconsumed group, in arrival order (assigned ones too)."""
    seen: list[str]
    """The ids of every group stored in the log's segments, in order."""
    batches: dict[int, list[list[str] | None]]
    """Step -> the group ids of each rank's shard still assigned (None: acknowledged or released)."""


class _State:
    """The log's records applied in order."""

    def __init__(self) -> None:
        self.stored: OrderedDict[str, tuple] = OrderedDict()  # unconsumed id -> (blob, segment)
        self.seen: dict[str, None] = {}
        self.trained: dict[str, list[int]] = {}  # id -> [step, rank] of the shard acknowledged with it
        self.dropped: set[str] = set()
        self.batches: dict[int, list[list[str] | None]] = {}
        self.assignments: list[tuple[int, list[list[str]]]] = []
        self.released: list[tuple[int, int]] = []

    def apply(self, rec: dict, raw, seg: int) -> None:
        kind = rec["k"]
        if kind == "g":
            self.seen[rec["id"]] = None
            self.stored[rec["id"]] = (raw, seg)
        elif kind == "c":
            shard = rec.get("shard")
            for gid in rec["ids"]:
                self.stored.pop(gid, None)
                if shard is None:
                    self.dropped.add(gid)
                else:
                    self.trained[gid] = list(shard)
        elif kind == "a":
            shards = [list(ids) for ids in rec["shards"]]
            self.batches[rec["step"]] = [list(ids) for ids in shards]
            self.assignments.append((rec["step"], shards))
        elif kind == "r":
            step, rank = rec["step"], rec["rank"]
            self.released.append((step, rank))
            shards = self.batches.get(step)
            if shards is not None and 0 <= rank < len(shards):
                shards[rank] = None

    def open_batches(self) -> dict[int, list[list[str] | None]]:
        """Steps with a shard neither released nor consumed: each shard's unconsumed ids."""
        out = {}
        for step, shards in self.batches.items():
            live = [[gid for gid in ids if gid in self.stored] or None if ids is not None else None
                    for ids in shards]
            if any(live):
                out[step] = live
        return out


def _records(path: Path, last: bool, repair: bool):
    """(meta, raw bytes) of each whole record of a segment. A torn tail of the last segment ends
    it (and is cut off with `repair`); anywhere else it is corruption."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return  # removed (all consumed) by a live replay while we looked
    if not data.strip(b"\0"):
        return  # created, and the process died before its first block was written
    if data[:len(MAGIC)] != MAGIC:
        raise RuntimeError(f"{path} is not a replay log segment of this version "
                           f"(expected {MAGIC!r} at its start)")
    pos = BLOCK
    while pos + _HEAD.size <= len(data):
        meta_len, raw_len, digest = _HEAD.unpack_from(data, pos)
        start = pos + blocks(_HEAD.size + meta_len)
        if not 0 < meta_len <= _MAX_META or start + raw_len > len(data):
            break
        meta = data[pos + _HEAD.size:pos + _HEAD.size + meta_len]
        raw = data[start:start + raw_len]
        if _digest(meta, raw) != digest:
            break
        yield msgpack.unpackb(meta, raw=False), raw
        pos = start + blocks(raw_len)
    if pos < len(data):
        if not last:
            raise RuntimeError(f"replay log segment {path} is corrupt at byte {pos}")
        if repair:
            os.truncate(path, pos)  # a torn write at the tail: cut it off


def history(directory: str | os.PathLike) -> dict:
    """What the log in `directory` records, read without changing a byte (a torn tail is left
    in place and ignored), for audits of a run or a crash test:

        stored       ids of every group stored in the remaining segments, in order
        consumed     ids consumed: trained ∪ dropped
        trained      id -> [step, rank] of the acknowledged shard it was in
        dropped      ids dropped as too stale
        assignments  [(step, [[ids of rank 0], [ids of rank 1], ...]), ...] every batch cut, in order
        released     [(step, rank), ...] shards that went back to the queue, in order
        open         step -> ids of each rank's shard still assigned (None: acknowledged or released)
        queued       ids stored, unconsumed and not in an open shard, in order
        complete     whether the log still has its first segment (nothing was pruned)

    A log removes segments whose groups were all consumed (`ReplayLog(prune=True)`, the
    default), and the first removed takes the start of the history with it: an audit of a
    whole run needs a log kept with `prune=False`."""
    path = Path(directory)
    segments = sorted(int(p.stem) for p in path.glob("*.seg"))
    state = _State()
    for seg in segments:
        for rec, _ in _records(path / f"{seg:08d}.seg", last=seg == segments[-1], repair=False):
            state.apply(rec, None, seg)
    open_ = state.open_batches()
    held = {gid for shards in open_.values() for ids in shards if ids for gid in ids}
    return {"stored": list(state.seen), "consumed": set(state.trained) | state.dropped,
            "trained": state.trained, "dropped": state.dropped, "assignments": state.assignments,
            "released": state.released, "open": open_,
            "queued": [gid for gid in state.stored if gid not in held], "complete": segments[:1] in ([], [1])}


def groups(directory: str | os.PathLike):
    """Every group stored in the log's remaining segments, decoded and validated, in order; read
    without changing a byte, like `history` (a run's trajectories, for an audit or a test)."""
    from replay.wire import decode_group

    path = Path(directory)
    segments = sorted(int(p.stem) for p in path.glob("*.seg"))
    for seg in segments:
        for rec, raw in _records(path / f"{seg:08d}.seg", last=seg == segments[-1], repair=False):
            if rec["k"] == "g":
                yield decode_group(bytes(raw))


class ReplayLog:
    def __init__(self, directory: str | os.PathLike, fsync: str = "interval", fsync_interval_s: float = 1.0,
                 segment_bytes: int = 256 << 20, direct: bool = True, prune: bool = True) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"--replay.fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync, self.fsync_interval_s, self.segment_bytes = fsync, fsync_interval_s, segment_bytes
        self.prune = prune
        """Remove segments whose groups are all consumed (off: keep the whole history, for audits)."""
        self.direct = direct and hasattr(os, "O_DIRECT")
        """Segments opened with O_DIRECT (turned off, for good, where the filesystem refuses it)."""
        self._live: OrderedDict[int, set[str]] = OrderedDict()  # segment -> unconsumed group ids in it
        self._where: dict[str, int] = {}
        self._fd: int | None = None
        self._pos = self._written = 0  # end of the segment with, and without, what is queued
        self._queued: list = []
        self._segment = 0
        self._last_sync = time.monotonic()
        self._scratch = mmap.mmap(-1, 8 << 20)  # page-aligned: heads, and blobs that are not
        self._spare: list[mmap.mmap] = []  # scratch buffers back from the I/O thread
        self._used = 0
        self.submit = None
        """Where writes, syncs and closes go (a LogWriter's I/O queue); None: done inline."""

    # -- recovery -------------------------------------------------------------
    def recover(self) -> tuple[list[bytes], list[str]]:
        """Read the log: (unconsumed group blobs in arrival order, the ids of every group stored
        in the log's segments, in order). `restore` says which of them are assigned too."""
        found = self.restore()
        return [blob for _, blob in found.groups], found.seen

    def restore(self) -> Recovered:
        """Read the log (cutting off a torn tail) and append from where it ends: the unconsumed
        groups, and the shards still assigned (see `Recovered`)."""
        segments = self.segments()
        state = _State()
        for seg in segments:
            for rec, raw in _records(self._path(seg), last=seg == segments[-1], repair=True):
                state.apply(rec, raw, seg)
        for gid, (_, seg) in state.stored.items():
            self._live.setdefault(seg, set()).add(gid)
            self._where[gid] = seg
        for seg in segments:
            self._live.setdefault(seg, set())
        self._live = OrderedDict(sorted(self._live.items()))
        self._segment = segments[-1] if segments else 0
        self._roll()
        self._collect()
        return Recovered([(gid, blob) for gid, (blob, _) in state.stored.items()], list(state.seen),
                         state.open_batches())

    # -- appending -------------------------------------------------------------
    def _path(self, seg: int) -> Path:
        return self.dir / f"{seg:08d}.seg"

    def _open(self, path: Path, direct: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        return os.open(path, flags, 0o600)

    def _io(self, action) -> None:
        """Run a write, sync or close: now, or (with a LogWriter) in order on its I/O thread."""
        if self.submit is None:
            action()
        else:
            self.submit(action)

    def _roll(self) -> None:
        if self._fd is not None:
            self._flush()
            self._io(functools.partial(_fsync_close, self._fd))
        self._segment += 1
        path = self._path(self._segment)
        head = MAGIC.ljust(BLOCK, b"\0")
        self._fd = None
        if self.direct:
            try:  # O_DIRECT must take an aligned block here, or the segment goes through the page cache
                self._fd = self._open(path, True)
                os.pwrite(self._fd, self._buffer(BLOCK, head), 0)
            except OSError:
                if self._fd is not None:
                    os.close(self._fd)
                self._fd, self.direct = None, False
        if self._fd is None:
            self._fd = self._open(path, False)
            os.pwrite(self._fd, head, 0)
        self._pos = self._written = BLOCK
        self._used = 0
        self._live[self._segment] = set()

    def _buffer(self, n: int, fill: bytes = b"") -> memoryview:
        """`n` bytes of page-aligned scratch memory (starting with `fill`), valid until written."""
        if self._used + n > len(self._scratch):
            self._flush()
            if n > len(self._scratch):
                self._scratch = mmap.mmap(-1, blocks(n))
        view = memoryview(self._scratch)[self._used:self._used + n]
        view[:len(fill)] = fill
        self._used += blocks(n)
        return view

    def _emit(self, parts: list) -> None:
        """Queue `parts` to be written after what is queued already (by `_flush`)."""
        self._queued += parts
        self._pos += sum(len(p) for p in parts)

    def _flush(self) -> None:
        """Write everything queued, in few system calls, each as large as the kernel takes. The
        scratch memory goes with the write; the next records get a fresh (or returned) buffer."""
        if not self._queued:
            return
        parts, self._queued = self._queued, []
        self._io(functools.partial(_pwrite, self._fd, self._path(self._segment), parts, self._written,
                                   self._scratch, self._spare))
        self._written = self._pos
        self._scratch = self._spare.pop() if self._spare else mmap.mmap(-1, max(len(self._scratch), 8 << 20))
        self._used = 0

    def _append(self, rec: dict, raw=b"", padded=None, raw_sum: int | None = None) -> None:
        """One record. `padded`, if given, is `raw` extended with zeros to whole blocks, in
        page-aligned memory (an actor's arena extent): it is written as it is. `raw_sum`, if
        given, is `checksum(raw)`."""
        meta = msgpack.packb(rec, use_bin_type=True)
        raw = memoryview(raw).cast("B")
        head_len, body_len = blocks(_HEAD.size + len(meta)), blocks(len(raw))
        in_place = padded is not None and len(padded) == body_len and _address(padded) % BLOCK == 0
        copy = self.direct and len(raw) > 0 and not in_place  # O_DIRECT needs aligned memory
        buf = self._buffer(head_len + (body_len if copy else 0))
        _HEAD.pack_into(buf, 0, len(meta), len(raw), _digest(meta, raw, raw_sum))
        buf[_HEAD.size:_HEAD.size + len(meta)] = meta
        buf[_HEAD.size + len(meta):head_len] = bytes(head_len - _HEAD.size - len(meta))
        if copy:
            buf[head_len:head_len + len(raw)] = raw
            buf[head_len + len(raw):] = bytes(body_len - len(raw))
            parts = [buf]
        elif in_place:
            parts = [buf, padded]
        else:
            parts = [buf, raw, bytes(body_len - len(raw))]
        self._emit([p for p in parts if len(p)])

    def sync(self, force: bool = False) -> None:
        """Write what was appended, and make it durable as the policy says (once written, it is
        with the OS or the device: it survives a crash of this process)."""
        self._flush()
        now = time.monotonic()
        if force or self.fsync == "always" or (
                self.fsync == "interval" and now - self._last_sync >= self.fsync_interval_s):
            self._io(functools.partial(os.fdatasync, self._fd))
            self._last_sync = now

    def stored(self, group_id: str, blob, sync: bool = True, padded=None, blob_sum: int | None = None) -> None:
        """Record a stored group; durable per the fsync policy when this returns (with `sync`;
        otherwise once `sync()` has been called). `blob_sum`: `checksum(blob)`, if known."""
        self._append({"k": "g", "id": group_id}, blob, padded, blob_sum)
        self._live[self._segment].add(group_id)
        self._where[group_id] = self._segment
        if sync:
            self.sync()
        if self._pos >= self.segment_bytes:
            self._roll()

    def assigned(self, step: int, shards: list[list[str]], sync: bool = True) -> None:
        """Record step `step`'s batch cut into shards (the group ids of each rank's, in order)."""
        self._append({"k": "a", "step": step, "shards": [list(ids) for ids in shards]})
        if sync:
            self.sync()

    def released(self, step: int, rank: int, sync: bool = True) -> None:
        """Record that rank `rank`'s shard of `step` went back to the queue, never trained on."""
        self._append({"k": "r", "step": step, "rank": rank})
        if sync:
            self.sync()

    def consumed(self, group_ids: list[str], sync: bool = True, shard: tuple[int, int] | None = None) -> None:
        """Record groups the learner has trained on (the (step, rank) of their `shard`) or that
        were dropped (no shard); drop segments that hold nothing live."""
        rec = {"k": "c", "ids": list(group_ids)}
        if shard is not None:
            rec["shard"] = list(shard)
        self._append(rec)
        for gid in group_ids:
            seg = self._where.pop(gid, None)
            if seg is not None:
                self._live[seg].discard(gid)
        if sync:
            self.sync()
        self._collect()

    def _collect(self) -> None:
        while self.prune and len(self._live) > 1:
            seg, ids = next(iter(self._live.items()))
            if ids or seg == self._segment:
                break
            self._live.popitem(last=False)
            self._path(seg).unlink(missing_ok=True)

    def segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.dir.glob("*.seg"))

    def close(self) -> None:
        if self._fd is not None:
            self._flush()
            self._io(functools.partial(_fsync_close, self._fd))
            self._fd = None
