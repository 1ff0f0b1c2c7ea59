"""Safetensors bytes written and read without joining them: the weight channel's adapter blob.

`write_safetensors` lays an adapter out as pieces (the JSON header, then each tensor's own memory
where it is already in the wire dtype, contiguous and on the CPU, else a copy converted on
background threads); `from_safetensors` decodes bytes held as consecutive buffers into tensors
that are views of them where they can be. The format is small and documented (8-byte header
length, JSON header, contiguous little-endian data), so it is read and written here; a test pins
that the `safetensors` library reads what we write and we read what it writes.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_MAX_HEADER = 100 << 20  # as the safetensors library: a JSON header past this is not an adapter
_COPY_THREADS = min(4, os.cpu_count() or 1)


def _dtypes() -> dict[str, Any]:
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
            "U8": torch.uint8, "BOOL": torch.bool}


def to_safetensors(tensors: dict, dtype=None) -> memoryview:
    """`tensors` as safetensors bytes, in one new buffer (floating tensors cast to `dtype`, a torch
    dtype). Names are sorted by element size, then name, as the library does, so that every
    tensor's data is aligned to its element size."""
    blob = write_safetensors(tensors, dtype)
    out = bytearray(blob.size)
    pos = 0
    for view in blob.views(0, blob.size):
        out[pos:pos + len(view)] = view
        pos += len(view)
    return memoryview(out)


def write_safetensors(tensors: dict, dtype=None) -> "Pieces":
    """`to_safetensors` without joining: the header, then each tensor's data as its own piece. A
    tensor already in its wire dtype, contiguous and on the CPU is its own memory (no copy: the
    caller must not change it while the bytes are in use); any other is converted (cast, made
    contiguous, moved to the CPU) on background threads in the order the pieces lie, so that the
    first chunks can leave while the last are converted (`views` waits for what it needs).
    ValueError at once for tensors that cannot travel."""
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
    pieces, sizes, pool = [len(head).to_bytes(8, "little") + head], [8 + len(head)], None

    def raw(t) -> memoryview:
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())

    def convert(t, target) -> memoryview:  # torch's copy releases the GIL: several run at once
        return raw(t.to(device="cpu", dtype=target).contiguous())

    for _, name, t, target in items:
        if t.numel() == 0:
            continue
        if t.dtype == target and t.device.type == "cpu" and t.is_contiguous():
            pieces.append(raw(t))
        else:
            pool = pool or ThreadPoolExecutor(_COPY_THREADS)  # runs its jobs in the order submitted
            pieces.append(pool.submit(convert, t, target))
        sizes.append(t.numel() * target.itemsize)
    if pool is not None:
        pool.shutdown(wait=False)  # its threads end when the last job is done
    return Pieces(pieces, sizes)


class Pieces:
    """Byte ranges of a blob held as consecutive buffers (or futures of buffers, with their
    `sizes`), read without joining them."""

    def __init__(self, pieces: list, sizes: list[int] | None = None) -> None:
        self.pieces = pieces
        self.starts = [0]
        for n in sizes if sizes is not None else map(len, pieces):
            self.starts.append(self.starts[-1] + n)
        self.size = self.starts[-1]

    def piece(self, i: int) -> memoryview:
        """Piece `i`, once it is written."""
        p = self.pieces[i]
        return memoryview(p.result() if isinstance(p, Future) else p)

    def views(self, lo: int, hi: int) -> list[memoryview]:
        """Bytes [lo, hi) as views of the pieces they lie in, in order."""
        out = []
        while lo < hi:
            i = bisect.bisect_right(self.starts, lo) - 1
            n = min(hi, self.starts[i + 1]) - lo
            out.append(self.piece(i)[lo - self.starts[i]:lo - self.starts[i] + n])
            lo += n
        return out

    def read(self, lo: int, hi: int, align: int = 1):
        """Bytes [lo, hi): a view of one piece when the range lies in it, its offset there is a
        multiple of `align` and the piece is writable (torch has no read-only tensors), else a copy."""
        views = self.views(lo, hi)
        offset = lo - self.starts[bisect.bisect_right(self.starts, lo) - 1]
        if len(views) == 1 and offset % align == 0 and not views[0].readonly:
            return views[0]
        out, pos = bytearray(hi - lo), 0
        for view in views:
            out[pos:pos + len(view)] = view
            pos += len(view)
        return out


def from_safetensors(pieces: list) -> dict:
    """Decode safetensors bytes held as consecutive buffers (`pieces`); the tensors are views of the
    buffers where they can be. ValueError, saying what is wrong, for anything else than
    safetensors: a header past the data, holes or overlaps, a dtype or shape that does not fit."""
    import torch

    dtypes, blob = _dtypes(), Pieces(pieces)
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
