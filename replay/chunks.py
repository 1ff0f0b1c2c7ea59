"""An adapter on the wire: safetensors bytes cut into chunks that each fit the frame cap.

The weight channel (replay/weights.py) sends an adapter as `count` messages of two frames:

    [header, data]   header = pack("adapter_chunk", version, index, count, total, digest, sha,
                                   base_model and config on chunk 0), signed with the run's key
                     data   = bytes [index·chunk, (index+1)·chunk) of the safetensors blob

and, after them and then every `announce_s`, a one-frame announcement pack("adapter_head", version).

Decisions, and why:

- **One hash pass.** `sha` is the SHA-256 of this chunk's data; `digest`, the adapter's digest,
  is the SHA-256 of the chunks' `sha`s in order (a hash list, as BitTorrent's pieces). Every
  header carries `digest`, and is signed (HMAC-SHA256 over the header, replay.wire's `pack`), so
  a chunk's data is authenticated through its signed `sha` (as strong as an HMAC over the data
  while SHA-256 resists collisions), at the cost of hashing every byte once, not twice (an HMAC, then a whole-blob SHA-256). On a
  small machine that pass is most of what the channel costs beyond the socket (bench/weights.py,
  docs/weights.md); the chunks also hash in parallel on the publisher.
- **No copies.** The publisher writes the safetensors blob itself, casting to the wire dtype in
  the same pass, into one buffer that ZeroMQ sends without copying. The subscriber keeps the
  chunk frames as ZeroMQ received them, and the decoded tensors are views of them: only a tensor
  that straddles two chunks is copied. So the format is read and written here (it is a small,
  documented format: 8-byte header length, JSON header, contiguous little-endian data), and a
  test pins that `safetensors` reads what we write and we read what it writes.
- **What a failure means.** A frame that is unsigned, wrongly signed or not our schema is a
  stranger's or garbage: `WireError`, rejected and counted. A chunk whose header is signed and
  well formed comes from our publisher (without a key: any chunk of our schema); if its adapter cannot be rebuilt (a chunk missing or
  corrupt, digests that do not add up, bytes that are not safetensors, header fields of the wrong
  type) that is `BrokenAdapter`, which the subscriber must not swallow.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from replay import wire
from replay.wire import WireError, pack, unpack

CHUNK_BYTES = 16 << 20
"""Data bytes per chunk (16 MiB): well under the frame cap, small enough to pipeline."""
_DIGEST = 32
_MAX_HEADER = 100 << 20  # as the safetensors library: a JSON header past this is not an adapter
_HASH_THREADS = min(4, os.cpu_count() or 1)


class BrokenAdapter(WireError):
    """An adapter from our own publisher (signed, well-formed headers) that cannot be rebuilt."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"adapter version {version}: {reason}")
        self.version, self.reason = version, reason


def _dtypes() -> dict[str, Any]:
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
            "U8": torch.uint8, "BOOL": torch.bool}


def to_safetensors(tensors: dict, dtype=None) -> memoryview:
    """`tensors` as safetensors bytes, in one new buffer (floating tensors cast to `dtype`, a torch
    dtype, in the same copy). Names are sorted by element size, then name, as the library does,
    so that every tensor's data is aligned to its element size."""
    import torch

    assert sys.byteorder == "little", "safetensors data is little-endian"
    names = {v: k for k, v in _dtypes().items()}
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"adapter tensors must map names to tensors, got {name!r}: {type(t).__name__}")
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if target not in names:
            raise ValueError(f"tensor {name!r}: dtype {target} cannot travel as safetensors")
        items.append((-target.itemsize, name, t.detach(), target))
    items.sort(key=lambda item: item[:2])
    header, offset = {}, 0
    for _, name, t, target in items:
        size = t.numel() * target.itemsize
        header[name] = {"dtype": names[target], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    start = 8 + len(head)
    buf = torch.empty(start + offset, dtype=torch.uint8)  # not zeroed: every byte is written below
    buf[:start] = torch.frombuffer(bytearray(len(head).to_bytes(8, "little") + head), dtype=torch.uint8)

    def fill(item) -> None:  # torch's copy releases the GIL: the tensors copy on several threads
        _, name, t, target = item
        lo, hi = header[name]["data_offsets"]
        if hi > lo:
            buf[start + lo:start + hi].view(target).view(t.shape).copy_(t)

    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        list(pool.map(fill, items))
    return memoryview(buf.numpy())


class _Pieces:
    """Byte ranges of a blob held as consecutive buffers, read without joining them."""

    def __init__(self, pieces: list) -> None:
        self.pieces = pieces
        self.starts = [0]
        for p in pieces:
            self.starts.append(self.starts[-1] + len(p))
        self.size = self.starts[-1]

    def read(self, lo: int, hi: int, align: int = 1):
        """Bytes [lo, hi): a view of one piece when the range lies in it, its offset there is a
        multiple of `align` and the piece is writable (torch has no read-only tensors), else a copy."""
        i = bisect.bisect_right(self.starts, lo) - 1
        off = lo - self.starts[i]
        if hi <= self.starts[i + 1] and off % align == 0 and not memoryview(self.pieces[i]).readonly:
            return self.pieces[i][off:off + hi - lo]
        out, pos = bytearray(hi - lo), lo
        while pos < hi:
            i = bisect.bisect_right(self.starts, pos) - 1
            n = min(hi, self.starts[i + 1]) - pos
            out[pos - lo:pos - lo + n] = self.pieces[i][pos - self.starts[i]:pos - self.starts[i] + n]
            pos += n
        return out


def from_safetensors(pieces: list) -> dict:
    """Decode safetensors bytes held as consecutive buffers (`pieces`); the tensors are views of the
    buffers where they can be. ValueError, saying what is wrong, for anything else than
    safetensors: a header past the data, holes or overlaps, a dtype or shape that does not fit."""
    import torch

    dtypes, blob = _dtypes(), _Pieces(pieces)
    if blob.size < 8:
        raise ValueError(f"{blob.size} bytes is too short for a safetensors header")
    n = int.from_bytes(blob.read(0, 8), "little")
    if n > min(blob.size - 8, _MAX_HEADER):
        raise ValueError(f"the header length ({n}) runs past the {blob.size} bytes")
    try:
        header = json.loads(bytes(blob.read(8, 8 + n)))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ must map names to strings")
    spans = []
    for name, spec in header.items():
        spec = spec if isinstance(spec, dict) else {}
        dtype, shape, offsets = dtypes.get(spec.get("dtype")), spec.get("shape"), spec.get("data_offsets")
        if dtype is None or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2 \
                or not all(type(x) is int and x >= 0 for x in shape + offsets):
            raise ValueError(f"tensor {name!r}: bad entry {spec!r}")
        if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}")
        spans.append((offsets[0], offsets[1], name, dtype, shape))
    spans.sort(key=lambda s: s[:3])
    start, pos = 8 + n, 0
    for lo, hi, name, *_ in spans:
        if lo != pos:
            raise ValueError(f"tensor {name!r}: the data has a hole or an overlap at byte {pos}")
        pos = hi
    if start + pos != blob.size:
        raise ValueError(f"the header describes {pos} data bytes, the blob holds {blob.size - start}")
    tensors = {}
    for lo, hi, name, dtype, shape in spans:
        if hi == lo:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(blob.read(start + lo, start + hi, dtype.itemsize), dtype=dtype).view(shape)
    return tensors


def _sha(data) -> bytes:
    return hashlib.sha256(data).digest()  # hashlib releases the GIL on large buffers


def chunk_messages(blob: memoryview, version: int, base_model: str, config: dict, key: bytes | None,
                   chunk_bytes: int = CHUNK_BYTES) -> list[list]:
    """The messages ([signed header, data view]) that carry `blob`, `chunk_bytes` of data each."""
    pieces = [blob[i:i + chunk_bytes] for i in range(0, len(blob), chunk_bytes)]
    with ThreadPoolExecutor(min(_HASH_THREADS, len(pieces))) as pool:
        shas = list(pool.map(_sha, pieces))
    digest = _sha(b"".join(shas))
    return [[pack("adapter_chunk", key=key, version=version, index=i, count=len(pieces), total=len(blob),
                  digest=digest, sha=sha, **({"base_model": base_model, "config": config} if i == 0 else {})),
             piece] for i, (piece, sha) in enumerate(zip(pieces, shas))]


@dataclass
class ChunkHead:
    """The checked header of one chunk."""

    version: int
    index: int
    count: int
    total: int
    digest: bytes
    sha: bytes
    base_model: str | None = None
    config: dict | None = None


def _buffer(part) -> memoryview:
    return part.buffer if hasattr(part, "buffer") else memoryview(part)  # a zmq.Frame, or bytes


def announcement(version: int, key: bytes | None) -> bytes:
    """The one-frame message that says `version` is the newest published (after all its chunks)."""
    return pack("adapter_head", key=key, version=version)


def read_announcement(frame, key: bytes | None) -> int:
    """The version an announcement names; WireError if it is not a signed, well-formed one."""
    version = unpack(_buffer(frame).tobytes(), ("adapter_head",), key=key).get("version")
    if type(version) is not int or version < 0:
        raise WireError("adapter announcement: no valid version")
    return version


def read_chunk(parts: list, key: bytes | None) -> tuple[ChunkHead, memoryview]:
    """(header, data) of one chunk message. WireError if it is not a signed, schema-conforming
    chunk (a stranger's, or garbage); BrokenAdapter if it is, but its fields are wrong."""
    if len(parts) != 2:
        raise WireError(f"adapter chunk: expected 2 frames (header, data), got {len(parts)}")
    msg = unpack(_buffer(parts[0]).tobytes(), ("adapter_chunk",), key=key)
    version = msg.get("version")
    if type(version) is not int or version < 0:
        raise WireError("adapter chunk: no valid version")
    fields = [msg.get(k) for k in ("index", "count", "total", "digest", "sha")]
    index, count, total, digest, sha = fields
    if not all(type(x) is int for x in fields[:3]) or not all(isinstance(x, bytes) and len(x) == _DIGEST
                                                             for x in fields[3:]):
        raise BrokenAdapter(version, "a chunk header's index, count, total or digests have the wrong type")
    if not 0 <= index < count or total < 0:
        raise BrokenAdapter(version, f"chunk header out of range (index {index}, count {count}, total {total})")
    data = _buffer(parts[1])
    if len(data) > wire.MAX_FRAME:
        raise BrokenAdapter(version, f"chunk {index} holds {len(data)} bytes, over the {wire.MAX_FRAME}-byte "
                                     "frame cap: the publisher's chunk size must be below it")
    head = ChunkHead(version, index, count, total, digest, sha)
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
    """One version's chunks as they arrive, each checked against its signed digest, then the whole.

    Usage::

        asm = Assembly(head)
        asm.add(head, data)          # for each chunk of head.version, in the order sent
        asm.check()                  # hash the chunks added since the last check
        if asm.complete:
            base_model, config, tensors = asm.finish()

    Every method raises BrokenAdapter when the chunks cannot become that version's adapter."""

    def __init__(self, head: ChunkHead) -> None:
        self.version, self.count, self.total, self.digest = head.version, head.count, head.total, head.digest
        self.data: dict[int, memoryview] = {}
        self.shas: dict[int, bytes] = {}
        self.first: ChunkHead | None = None
        self._unchecked: list[int] = []
        self.updated = time.monotonic()
        """When the last chunk was added (a stalled assembly has lost its tail)."""

    def missing(self) -> str:
        """The indexes not received yet, as ranges ("3-5, 9")."""
        return _ranges([i for i in range(self.count) if i not in self.data])

    def add(self, head: ChunkHead, data: memoryview) -> None:
        """Add a chunk of this version. Chunks come in order on one connection, so a gap means the
        ones between were dropped (a subscriber past its high-water mark, a reconnect, a late join)."""
        assert head.version == self.version
        if (head.count, head.total, head.digest) != (self.count, self.total, self.digest):
            raise BrokenAdapter(self.version, "chunks of two different adapters claim this version (their count, "
                                              "length or digest differ): is more than one learner publishing?")
        if head.index in self.data:
            raise BrokenAdapter(self.version, f"chunk {head.index} of {self.count} arrived twice")
        if head.index != len(self.data):
            raise BrokenAdapter(self.version, f"chunks {_ranges(list(range(len(self.data), head.index)))} of "
                                              f"{self.count} never arrived (dropped on the way)")
        self.data[head.index], self.shas[head.index] = data, head.sha
        self.first = self.first or (head if head.index == 0 else None)
        self._unchecked.append(head.index)
        self.updated = time.monotonic()

    def check(self) -> None:
        """Hash the chunks added since the last call against their signed digests."""
        for i in self._unchecked:
            if _sha(self.data[i]) != self.shas[i]:
                raise BrokenAdapter(self.version, f"chunk {i} of {self.count} does not match its digest "
                                                  "(corrupted on the way)")
        self._unchecked = []

    @property
    def complete(self) -> bool:
        """Whether every chunk is here."""
        return len(self.data) == self.count

    def finish(self) -> tuple[str, dict, dict]:
        """(base model id, adapter config, tensors) once every chunk is here and checked."""
        self.check()
        if not self.complete:
            raise BrokenAdapter(self.version, f"chunks {self.missing()} of {self.count} never arrived")
        size = sum(len(d) for d in self.data.values())
        if size != self.total:
            raise BrokenAdapter(self.version, f"the chunks hold {size} bytes, the header says {self.total}")
        if _sha(b"".join(self.shas[i] for i in range(self.count))) != self.digest:
            raise BrokenAdapter(self.version, "the chunks' digests do not add up to the adapter's digest")
        try:
            tensors = from_safetensors([self.data[i] for i in range(self.count)])
        except ValueError as exc:
            raise BrokenAdapter(self.version, f"the reassembled bytes are not safetensors ({exc})") from None
        assert self.first is not None
        return self.first.base_model, self.first.config, tensors
