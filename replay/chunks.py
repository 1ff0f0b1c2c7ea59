"""An adapter on the wire: safetensors bytes cut into chunks that each fit the frame cap.

The weight channel (replay/weights.py) sends an adapter (format 3) as `count` chunk messages,
then one frame that commits it:

    [header, data...]  header = pack("adapter_chunk.v3", version, index, count, total, frames, mac,
                                     base_model and config on chunk 0), signed with the run's key
                       data   = bytes [index·chunk, (index+1)·chunk) of the safetensors blob, in
                                `frames` frames (one for each piece of the blob the chunk spans)
    [commit]           commit = pack("adapter_commit.v3", version, count, total, digest), signed

and the commit again every `announce_s` (it is also the announcement of the newest version).

Decisions, and why:

- **BLAKE3, keyed.** `mac` is the BLAKE3 of this chunk's data in keyed mode, under a key derived
  from the run's key (BLAKE3's derive_key mode, context "tandem adapter chunk v1"): a MAC that
  authenticates the data itself; without a run key it is the plain BLAKE3, an integrity check.
  The header is signed as every frame (HMAC-SHA256, replay.wire's `pack`), so it binds the data's
  MAC to its version and index. BLAKE3 runs at ~4 GiB/s a core where SHA-256 runs at ~1.6; every
  byte is still hashed once on each side, and on a small machine that pass is most of what the
  channel costs beyond the socket (bench/weights.py, docs/weights.md).
- **Sent as hashed.** The adapter's `digest` (keyed BLAKE3 of the chunks' MACs in order, a hash
  list as BitTorrent's pieces) travels in the commit, after the last chunk, not in every header:
  the publisher hashes chunk i, sends it, hashes chunk i + 1, and ZeroMQ's I/O thread sends while
  it hashes. The subscriber checks each chunk as it arrives and delivers the adapter only once
  the commit has come and its count, length and digest match what arrived: chunks of two
  different adapters that claim one version (two learners) do not add up to one digest.
- **Formats never mix.** Format 1 (SHA-256 digests, "adapter_chunk" / "adapter_head") and format 2
  (one data frame a chunk, ".v2") are not read: a signed frame of them is a `BrokenAdapter` that
  names the format, so that a learner and actors of different Tandem versions stop with that
  message rather than drop each other's frames.
- **No copies.** The blob is never joined: it is the header, then each tensor's own memory where
  the tensor is already in the wire dtype, contiguous and on the CPU (the learner hands over a
  snapshot), else a converted copy of it. ZeroMQ sends each piece a chunk spans as a frame,
  without copying. The subscriber keeps the frames as ZeroMQ received them, and the decoded
  tensors are views of them: only a tensor that straddles two chunks is copied. So the format
  is read and written in replay/tensorblob.py (a small, documented format: 8-byte header length, JSON
  header, contiguous little-endian data), and a test pins that `safetensors` reads what we
  write and we read what it writes.
- **What a failure means.** A frame that is unsigned, wrongly signed or not our schema is a
  stranger's or garbage: `WireError`, rejected and counted. A frame whose header is signed and
  well formed comes from our publisher (without a key: any frame of our schema); if its adapter
  cannot be rebuilt (a chunk missing or corrupt, a commit that never comes, digests that do not
  add up, bytes that are not safetensors, header fields of the wrong type, the old format) that
  is `BrokenAdapter`, which the subscriber must not swallow.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Iterator

import blake3

from replay import wire
from replay.tensorblob import Pieces, from_safetensors
from replay.wire import WireError, pack, unpack

CHUNK_BYTES = 16 << 20
"""Data bytes per chunk (16 MiB): well under the frame cap, small enough to pipeline."""
CHUNK, COMMIT, SHM = "adapter_chunk.v3", "adapter_commit.v3", "adapter_shm.v3"
"""Message types of format 3 (SHM: a version in shared memory, replay/shm_weights.py); older
formats' are refused by name (_OLD)."""
_OLD = {"adapter_chunk": 1, "adapter_head": 1, "adapter_chunk.v2": 2, "adapter_commit.v2": 2}
_DIGEST = 32
_KEY_CONTEXT = "tandem adapter chunk v1"


class BrokenAdapter(WireError):
    """An adapter from our own publisher (signed, well-formed headers) that cannot be rebuilt."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"adapter version {version}: {reason}")
        self.version, self.reason = version, reason


@functools.lru_cache(maxsize=4)
def _mac_key(key: bytes | None) -> bytes | None:
    """The BLAKE3 key of the chunks' MACs, derived from the run's key (None: no key, plain BLAKE3)."""
    return None if key is None else blake3.blake3(key, derive_key_context=_KEY_CONTEXT).digest()


def _mac(data, key: bytes | None) -> bytes:
    """Keyed BLAKE3 of `data` (bytes, or a list of buffers hashed as their concatenation) under the
    run key's derived key (plain BLAKE3 without a key). The hash releases the GIL on large
    buffers, so ZeroMQ and other threads run meanwhile."""
    mac_key = _mac_key(key)
    hasher = blake3.blake3() if mac_key is None else blake3.blake3(key=mac_key)
    for piece in data if isinstance(data, list) else [data]:
        hasher.update(piece)
    return hasher.digest()


def _digest(macs: list[bytes], key: bytes | None) -> bytes:
    return _mac(b"".join(macs), key)


def stream_messages(blob, version: int, base_model: str, config: dict, key: bytes | None,
                    chunk_bytes: int = CHUNK_BYTES) -> Iterator[list]:
    """The messages that carry `blob` (a buffer, or `write_safetensors`' pieces), made as they are
    taken: [signed header, data views...] for each chunk of `chunk_bytes` (hashed when its turn
    comes, so the first leaves before the last is hashed or even converted), then [signed commit].
    A chunk's data is the views of the pieces it spans: one frame each, sent without copying."""
    blob = blob if isinstance(blob, Pieces) else Pieces([blob])
    count, macs = -(-blob.size // chunk_bytes), []
    for i in range(count):
        views = blob.views(i * chunk_bytes, min((i + 1) * chunk_bytes, blob.size))
        macs.append(_mac(views, key))
        yield [pack(CHUNK, key=key, version=version, index=i, count=count, total=blob.size, mac=macs[-1],
                    frames=len(views), **({"base_model": base_model, "config": config} if i == 0 else {})),
               *views]
    yield [commit(Commit(version, count, blob.size, _digest(macs, key)), key)]


def chunk_messages(blob, version: int, base_model: str, config: dict, key: bytes | None,
                   chunk_bytes: int = CHUNK_BYTES) -> list[list]:
    """All of `stream_messages`: the chunk messages, then the commit."""
    return list(stream_messages(blob, version, base_model, config, key, chunk_bytes))


def split_messages(parts: list, key: bytes | None) -> list[list]:
    """The frames of several messages sent as one (a "latest" reply: chunks, then the commit) cut
    back into messages by each chunk header's frame count. WireError if a header is not ours."""
    messages, i = [], 0
    while i < len(parts) - 1:
        version, msg = _read(parts[i], CHUNK, key)
        frames = msg.get("frames")
        if type(frames) is not int or not 1 <= frames <= len(parts) - 2 - i:
            raise BrokenAdapter(version, f"a chunk header claims {frames!r} data frames, the reply holds "
                                         f"{len(parts) - 2 - i} after it")
        messages.append(parts[i:i + 1 + frames])
        i += 1 + frames
    return messages + [parts[-1:]]


@dataclass
class ChunkHead:
    """The checked header of one chunk."""

    version: int
    index: int
    count: int
    total: int
    mac: bytes
    base_model: str | None = None
    config: dict | None = None


@dataclass
class Commit:
    """The checked commit of one version: what its chunks must add up to."""

    version: int
    count: int
    total: int
    digest: bytes


def _buffer(part) -> memoryview:
    return part.buffer if hasattr(part, "buffer") else memoryview(part)  # a zmq.Frame, or bytes


def _read(frame, msg_type: str | tuple[str, ...], key: bytes | None) -> tuple[int, dict]:
    """(version, fields) of a signed frame of `msg_type` (or one of several). WireError for a
    stranger's or garbage; BrokenAdapter for a signed frame of an older format."""
    types = (msg_type,) if isinstance(msg_type, str) else msg_type
    msg = unpack(_buffer(frame).tobytes(), (*types, *_OLD), key=key)
    version = msg.get("version")
    if type(version) is not int or version < 0:
        raise WireError(f"{msg_type}: no valid version")
    if msg["type"] in _OLD:
        raise BrokenAdapter(version, f"it came in format {_OLD[msg['type']]} ({msg['type']!r}), and this "
                                     f"subscriber reads format 3 ({types[0]!r}): the learner runs an older Tandem")
    return version, msg


def commit(done: Commit, key: bytes | None) -> bytes:
    """The one-frame message that commits `done.version` (after all its chunks, and as the
    periodic announcement of the newest version)."""
    return pack(COMMIT, key=key, version=done.version, count=done.count, total=done.total, digest=done.digest)


@dataclass
class ShmNote:
    """The announcement of a version written to a shared-memory file on the publisher's host."""

    version: int
    name: str
    size: int
    host: str
    base_model: str
    config: dict


def shm_note(note: ShmNote, key: bytes | None) -> bytes:
    """The one-frame message that announces `note` (before the version's chunks)."""
    return pack(SHM, key=key, version=note.version, name=note.name, size=note.size, host=note.host,
                base_model=note.base_model, config=note.config)


def read_news(frame, key: bytes | None) -> Commit | ShmNote:
    """The commit or shared-memory announcement a frame holds; WireError if it is neither (a
    stranger's or garbage), BrokenAdapter if it is ours but malformed."""
    version, msg = _read(frame, (COMMIT, SHM), key)
    if msg["type"] == COMMIT:
        return _commit(version, msg)
    fields = [msg.get(k) for k in ("name", "size", "host", "base_model", "config")]
    if not (isinstance(fields[0], str) and type(fields[1]) is int and isinstance(fields[2], str)
            and isinstance(fields[3], str) and isinstance(fields[4], dict)):
        raise BrokenAdapter(version, "its shared-memory announcement's fields have the wrong type")
    return ShmNote(version, *fields)


def read_commit(frame, key: bytes | None) -> Commit:
    """The commit a frame holds; WireError if it is not a signed, well-formed one."""
    return _commit(*_read(frame, COMMIT, key))


def _commit(version: int, msg: dict) -> Commit:
    count, total, digest = msg.get("count"), msg.get("total"), msg.get("digest")
    if type(count) is not int or type(total) is not int or count < 1 or total < 0 \
            or not isinstance(digest, bytes) or len(digest) != _DIGEST:
        raise BrokenAdapter(version, "its commit's count, total or digest is wrong or of the wrong type")
    return Commit(version, count, total, digest)


def read_chunk(parts: list, key: bytes | None) -> tuple[ChunkHead, list[memoryview]]:
    """(header, data frames) of one chunk message. WireError if it is not a signed,
    schema-conforming chunk (a stranger's, or garbage); BrokenAdapter if it is, but its fields
    are wrong."""
    if len(parts) < 2:
        raise WireError(f"adapter chunk: expected a header and data frames, got {len(parts)} frame(s)")
    version, msg = _read(parts[0], CHUNK, key)
    fields = [msg.get(k) for k in ("index", "count", "total", "frames", "mac")]
    index, count, total, frames, mac = fields
    if not all(type(x) is int for x in fields[:4]) or not isinstance(mac, bytes) or len(mac) != _DIGEST:
        raise BrokenAdapter(version, "a chunk header's index, count, total, frames or MAC have the wrong type")
    if not 0 <= index < count or total < 0:
        raise BrokenAdapter(version, f"chunk header out of range (index {index}, count {count}, total {total})")
    if frames != len(parts) - 1:
        raise BrokenAdapter(version, f"chunk {index} came with {len(parts) - 1} data frames, its header says {frames}")
    data = [_buffer(part) for part in parts[1:]]
    size = sum(len(d) for d in data)
    if size > wire.MAX_FRAME:
        raise BrokenAdapter(version, f"chunk {index} holds {size} bytes, over the {wire.MAX_FRAME}-byte "
                                     "frame cap: the publisher's chunk size must be below it")
    head = ChunkHead(version, index, count, total, mac)
    if index == 0:
        head.base_model, head.config = msg.get("base_model"), msg.get("config")
        if not isinstance(head.base_model, str) or not isinstance(head.config, dict):
            raise BrokenAdapter(version, "chunk 0 lacks the base model id (a string) or the adapter config (a map)")
    return head, data


def _ranges(indexes: list[int]) -> str:
    out, i = [], 0
    while i < len(indexes):
        j = i
        while j + 1 < len(indexes) and indexes[j + 1] == indexes[j] + 1:
            j += 1
        out.append(str(indexes[i]) if i == j else f"{indexes[i]}-{indexes[j]}")
        i = j + 1
    return ", ".join(out)


class Assembly:
    """One version's chunks as they arrive, each checked against its signed MAC, then the whole
    against the commit.

    Usage::

        asm = Assembly(head, key)
        asm.add(head, data)          # for each chunk of head.version, in the order sent
        asm.check()                  # hash the chunks added since the last check
        asm.seal(commit)             # the version's commit, after its last chunk
        if asm.ready:
            base_model, config, tensors = asm.finish()

    Every method raises BrokenAdapter when the chunks cannot become that version's adapter."""

    def __init__(self, head: ChunkHead, key: bytes | None) -> None:
        self.version, self.count, self.total, self.key = head.version, head.count, head.total, key
        self.data: dict[int, list[memoryview]] = {}
        self.macs: dict[int, bytes] = {}
        self.first: ChunkHead | None = None
        self.commit: Commit | None = None
        self._unchecked: list[int] = []
        self.updated = time.monotonic()
        """When the last chunk was added (a stalled assembly has lost its tail, or its commit)."""

    def missing(self) -> str:
        """The indexes not received yet, as ranges ("3-5, 9")."""
        return _ranges([i for i in range(self.count) if i not in self.data])

    def _same(self, count: int, total: int) -> None:
        if (count, total) != (self.count, self.total):
            raise BrokenAdapter(self.version, "chunks of two different adapters claim this version (their count "
                                              "or length differ): is more than one learner publishing?")

    def add(self, head: ChunkHead, data: list[memoryview]) -> None:
        """Add a chunk of this version. Chunks come in order on one connection, so a gap means the
        ones between were dropped (a subscriber past its high-water mark, a reconnect, a late join)."""
        assert head.version == self.version
        self._same(head.count, head.total)
        if head.index in self.data:
            raise BrokenAdapter(self.version, f"chunk {head.index} of {self.count} arrived twice")
        if head.index != len(self.data):
            raise BrokenAdapter(self.version, f"chunks {_ranges(list(range(len(self.data), head.index)))} of "
                                              f"{self.count} never arrived (dropped on the way)")
        self.data[head.index], self.macs[head.index] = data, head.mac
        self.first = self.first or (head if head.index == 0 else None)
        self._unchecked.append(head.index)
        self.updated = time.monotonic()

    def check(self) -> None:
        """Hash the chunks added since the last call against their signed MACs."""
        for i in self._unchecked:
            if _mac(self.data[i], self.key) != self.macs[i]:
                raise BrokenAdapter(self.version, f"chunk {i} of {self.count} does not match its digest "
                                                  "(corrupted on the way)")
        self._unchecked = []

    def seal(self, done: Commit) -> None:
        """Take this version's commit (it comes after the last chunk, and again periodically)."""
        assert done.version == self.version
        self._same(done.count, done.total)
        self.commit = done

    @property
    def complete(self) -> bool:
        """Whether every chunk is here."""
        return len(self.data) == self.count

    @property
    def ready(self) -> bool:
        """Whether every chunk and the commit are here."""
        return self.complete and self.commit is not None

    def finish(self) -> tuple[str, dict, dict]:
        """(base model id, adapter config, tensors) once every chunk is here and checked, and the
        commit says they are the adapter."""
        self.check()
        if not self.complete:
            raise BrokenAdapter(self.version, f"chunks {self.missing()} of {self.count} never arrived")
        if self.commit is None:
            raise BrokenAdapter(self.version, "every chunk arrived, but not the commit that follows them")
        size = sum(len(d) for frames in self.data.values() for d in frames)
        if size != self.total:
            raise BrokenAdapter(self.version, f"the chunks hold {size} bytes, the header says {self.total}")
        if _digest([self.macs[i] for i in range(self.count)], self.key) != self.commit.digest:
            raise BrokenAdapter(self.version, "the chunks' digests do not add up to the adapter's digest "
                                              "in its commit")
        try:
            tensors = from_safetensors([d for i in range(self.count) for d in self.data[i]])
        except ValueError as exc:
            raise BrokenAdapter(self.version, f"the reassembled bytes are not safetensors ({exc})") from None
        assert self.first is not None
        return self.first.base_model, self.first.config, tensors
