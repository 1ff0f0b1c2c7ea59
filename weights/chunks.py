"""An adapter on the wire: safetensors bytes cut into chunks that each fit the frame cap.

The weight channel sends an adapter (format 3) as `count` chunk messages, then one frame that
commits it (the messages are weights/wire.py's Structs, signed with the run's key):

    [ChunkHeader, data...]  data = bytes [index·chunk, (index+1)·chunk) of the safetensors blob,
                            in `frames` frames (one for each piece of the blob the chunk spans)
    [Commit]                the count, length and digest the chunks must add up to

and the commit again every `announce_s` (it is also the announcement of the newest version).

Decisions (the reasons and measurements: docs/weights.md):
- **BLAKE3, keyed.** A header's `mac` is the keyed BLAKE3 of its chunk's data under a key derived
  from the run's key (plain BLAKE3 without one); the signed header binds it to version and index.
- **Sent as hashed.** The adapter's digest (BLAKE3 of the MACs in order) travels in the commit,
  after the last chunk: the publisher hashes chunk i + 1 while ZeroMQ sends chunk i.
- **Formats never mix.** A signed frame of format 1 or 2 is a `BrokenAdapter` that names it.
- **No copies.** The blob is never joined (weights/format.py): tensors travel from their own
  memory and arrive as views of the frames; only a tensor that straddles two chunks is copied.
- **What a failure means.** A stranger's frame or garbage is a `WireError` (rejected, counted);
  an adapter of our own publisher that cannot be rebuilt is a `BrokenAdapter`, never swallowed.
"""

from __future__ import annotations

import functools
import time
from typing import Iterator

import blake3

from policy.adapter import Adapter
from weights import wire
from weights.format import Pieces, from_safetensors, write_safetensors
from weights.wire import OLD_TYPES, ChunkHeader, Commit, Malformed, ShmNote, WireError

CHUNK_BYTES = 16 << 20
"""Data bytes per chunk (16 MiB): well under the frame cap, small enough to pipeline."""
WIRE_DTYPES = (None, "bfloat16", "float16", "float32")
"""Choices for the publisher's `dtype` (None: as given)."""
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


def layout(adapter: Adapter, dtype: str | None, chunk_bytes: int | None, max_chunks: int | None):
    """(the adapter's safetensors pieces, the chunk size): floating tensors cast to `dtype` (one of
    WIRE_DTYPES), chunks of `chunk_bytes`, made larger (up to the frame cap) where the adapter
    would need more than `max_chunks`. ValueError for an adapter without tensors, or one that does
    not fit `max_chunks` frames."""
    import torch

    if dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {dtype!r}: choose one of {WIRE_DTYPES}")
    if not adapter.tensors:
        raise ValueError(f"adapter version {adapter.version} has no tensors: nothing to publish "
                         "(does the LoRA config target any module of the model?)")
    blob = write_safetensors(adapter.tensors, getattr(torch, dtype) if dtype else None)
    chunk = chunk_bytes or min(CHUNK_BYTES, wire.MAX_FRAME)
    if max_chunks:
        chunk = min(wire.MAX_FRAME, max(chunk, -(-blob.size // max_chunks)))
        if -(-blob.size // chunk) > max_chunks:
            raise ValueError(f"adapter version {adapter.version} ({blob.size} bytes) needs more than {max_chunks} "
                             f"chunks of the {wire.MAX_FRAME}-byte frame cap: raise the publisher's hwm")
    return blob, chunk


def encode_adapter(adapter: Adapter, key: bytes | None = None, *, dtype: str | None = None,
                   chunk_bytes: int | None = None, max_chunks: int | None = None) -> list[list]:
    """The messages that carry `adapter`: its chunks ([signed header, data...]), then its commit
    ([signed commit]); see `layout` for the arguments and the ValueErrors. Tensors already in the
    wire dtype, contiguous and on the CPU are sent from their own memory."""
    blob, chunk = layout(adapter, dtype, chunk_bytes, max_chunks)
    return list(stream_messages(blob, adapter.version, adapter.base_model, adapter.config, key, chunk))


def decode_adapter(messages: list[list], key: bytes | None = None) -> Adapter:
    """The adapter carried by `messages` (from `encode_adapter`, in order: chunks, then the commit).
    WireError if they are not signed, schema-conforming chunks; BrokenAdapter (a WireError) if they
    are our publisher's but do not make a whole adapter."""
    asm, done = None, None
    for parts in messages:
        if len(parts) == 1:
            done = read_commit(parts[0], key)
            continue
        head, data = read_chunk(parts, key)
        if asm is None:
            asm = Assembly(head, key)
        elif head.version != asm.version:
            raise BrokenAdapter(asm.version, f"versions {asm.version} and {head.version} mixed in one adapter")
        asm.add(head, data)
    if asm is None:
        raise WireError("no adapter chunks")
    if done is not None:
        if done.version != asm.version:
            raise BrokenAdapter(asm.version, f"a commit of version {done.version} came with its chunks")
        asm.seal(done)
    base_model, config, tensors = asm.finish()
    return Adapter(asm.version, base_model, config, tensors)


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
        head = ChunkHeader(version=version, index=i, count=count, total=blob.size, frames=len(views), mac=macs[-1],
                           **({"base_model": base_model, "config": config} if i == 0 else {}))
        yield [wire.encode(head, key), *views]
    yield [wire.encode(Commit(version=version, count=count, total=blob.size, digest=_digest(macs, key)), key)]


def chunk_messages(blob, version: int, base_model: str, config: dict, key: bytes | None,
                   chunk_bytes: int = CHUNK_BYTES) -> list[list]:
    """All of `stream_messages`: the chunk messages, then the commit."""
    return list(stream_messages(blob, version, base_model, config, key, chunk_bytes))


def split_messages(parts: list, key: bytes | None) -> list[list]:
    """The frames of several messages sent as one (a "latest" reply: chunks, then the commit) cut
    back into messages by each chunk header's frame count. WireError if a header is not ours."""
    messages, i = [], 0
    while i < len(parts) - 1:
        head = _read(parts[i], (ChunkHeader,), key)
        frames = head.frames
        if frames > len(parts) - 2 - i:
            raise BrokenAdapter(head.version, f"a chunk header claims {frames} data frames, the reply holds "
                                              f"{len(parts) - 2 - i} after it")
        messages.append(parts[i:i + 1 + frames])
        i += 1 + frames
    return messages + [parts[-1:]]


def _buffer(part) -> memoryview:
    return part.buffer if hasattr(part, "buffer") else memoryview(part)  # a zmq.Frame, or bytes


def _read(frame, types: tuple[type, ...], key: bytes | None):
    """The message of one of `types` in a signed frame. WireError for a stranger's or garbage;
    BrokenAdapter for a signed frame of ours that breaks its schema, or of an older format."""
    try:
        return wire.decode(frame, key, types)
    except Malformed as exc:
        if exc.version is None:
            raise WireError(f"{exc.msg_type}: no valid version ({exc.reason})") from None
        if exc.msg_type in OLD_TYPES:
            raise BrokenAdapter(exc.version, f"it came in format {OLD_TYPES[exc.msg_type]} ({exc.msg_type!r}), and "
                                             f"this subscriber reads format 3 ({types[0].__struct_config__.tag!r}): "
                                             "the learner runs an older Tandem") from None
        raise BrokenAdapter(exc.version, f"its {exc.msg_type} breaks the schema ({exc.reason})") from None


def read_news(frame, key: bytes | None) -> Commit | ShmNote:
    """The commit or shared-memory announcement a frame holds; WireError if it is neither (a
    stranger's or garbage), BrokenAdapter if it is ours but malformed."""
    return _read(frame, (Commit, ShmNote), key)


def read_commit(frame, key: bytes | None) -> Commit:
    """The commit a frame holds; WireError if it is not a signed, well-formed one."""
    return _read(frame, (Commit,), key)


def read_chunk(parts: list, key: bytes | None) -> tuple[ChunkHeader, list[memoryview]]:
    """(header, data frames) of one chunk message. WireError if it is not a signed,
    schema-conforming chunk (a stranger's, or garbage); BrokenAdapter if it is, but its fields
    do not agree."""
    if len(parts) < 2:
        raise WireError(f"adapter chunk: expected a header and data frames, got {len(parts)} frame(s)")
    head = _read(parts[0], (ChunkHeader,), key)
    version, index = head.version, head.index
    if not index < head.count:
        raise BrokenAdapter(version, f"chunk header out of range (index {index}, count {head.count})")
    if head.frames != len(parts) - 1:
        raise BrokenAdapter(version, f"chunk {index} came with {len(parts) - 1} data frames, its header says "
                                     f"{head.frames}")
    data = [_buffer(part) for part in parts[1:]]
    size = sum(len(d) for d in data)
    if size > wire.MAX_FRAME:
        raise BrokenAdapter(version, f"chunk {index} holds {size} bytes, over the {wire.MAX_FRAME}-byte "
                                     "frame cap: the publisher's chunk size must be below it")
    if index == 0 and (head.base_model is None or head.config is None):
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

    def __init__(self, head: ChunkHeader, key: bytes | None) -> None:
        self.version, self.count, self.total, self.key = head.version, head.count, head.total, key
        self.data: dict[int, list[memoryview]] = {}
        self.macs: dict[int, bytes] = {}
        self.first: ChunkHeader | None = None
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

    def add(self, head: ChunkHeader, data: list[memoryview]) -> None:
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
