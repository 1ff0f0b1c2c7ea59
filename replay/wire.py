"""Wire types: declared once, encoded as msgpack with arrays as raw bytes.

Every frame is a msgpack map with a schema version `v` and a `type`. Arrays
travel as {"dtype", "n", "data"} with little-endian raw bytes. Decoding never
trusts the peer: unknown schema, unknown type, wrong dtype, lengths that do not
match, non-finite rewards or a frame over the size cap all raise `WireError`,
which servers turn into an error reply and a counter. Nothing is pickled.

With a key (the launcher makes one per run), every frame is prefixed with an
HMAC-SHA256 of its body; a frame that is unsigned or tampered with is rejected
before it is decoded. A group travels as nested msgpack bytes, so replay stores
and serves exactly the bytes it validated, without re-encoding them.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA = 1
MAX_FRAME = 64 << 20
"""Frames larger than this are rejected before decoding (64 MiB)."""

FINISH_REASONS = ("terminated", "truncated", "length", "env_error")
"""terminated/truncated: as the environment said; length: the context limit; env_error: the environment failed."""
_DTYPES = {"int32": np.int32, "float32": np.float32, "uint8": np.uint8}


class WireError(ValueError):
    """A frame that does not follow the schema."""


def _array(a: np.ndarray, dtype: str) -> dict[str, Any]:
    a = np.ascontiguousarray(a, dtype=_DTYPES[dtype]).astype(np.dtype(_DTYPES[dtype]).newbyteorder("<"), copy=False)
    return {"dtype": dtype, "n": int(a.shape[0]), "data": a.tobytes()}


_LITTLE = {name: np.dtype(t).newbyteorder("<") for name, t in _DTYPES.items()}


def _unarray(obj: Any, dtype: str, what: str) -> np.ndarray:
    """A read-only view of the array's bytes (no copy on little-endian hosts)."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "n", "data"}:
        raise WireError(f"{what}: expected an array map with dtype, n, data")
    if obj["dtype"] != dtype:
        raise WireError(f"{what}: dtype {obj['dtype']!r}, expected {dtype!r}")
    n, data = obj["n"], obj["data"]
    if not isinstance(n, int) or not isinstance(data, bytes) or n < 0 or len(data) != n * _LITTLE[dtype].itemsize:
        raise WireError(f"{what}: length does not match its data")
    return np.frombuffer(data, dtype=_LITTLE[dtype])


def _get(obj: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in obj:
        raise WireError(f"{what}: missing field {key!r}")
    val = obj[key]
    if not isinstance(val, kind) or isinstance(val, bool) and kind in (int, float, (int, float)):
        raise WireError(f"{what}: field {key!r} has type {type(val).__name__}")
    return val


@dataclass
class Trajectory:
    """One episode, as the learner trains on it."""

    tokens: np.ndarray      # [T] int32, prompt + model + observation tokens
    logprobs: np.ndarray    # [T] float32, behaviour log μ on model tokens, 0 elsewhere
    mask: np.ndarray        # [T] uint8, 1 on model tokens (trained), 0 on prompt/observations
    versions: np.ndarray    # [T] int32, policy version that produced each model token
    reward: float
    turns: int
    finish_reason: str

    @property
    def version(self) -> int:
        """The oldest version among the model's tokens (the trajectory's version)."""
        model = self.versions[self.mask.astype(bool)]
        return int(model.min()) if model.size else int(self.versions.min(initial=0))

    def to_wire(self) -> dict[str, Any]:
        return {"tokens": _array(self.tokens, "int32"), "logprobs": _array(self.logprobs, "float32"),
                "mask": _array(self.mask, "uint8"), "versions": _array(self.versions, "int32"),
                "reward": float(self.reward), "turns": int(self.turns), "finish_reason": self.finish_reason}

    @classmethod
    def from_wire(cls, obj: Any) -> Trajectory:
        what = "trajectory"
        if not isinstance(obj, dict):
            raise WireError(f"{what}: expected a map")
        t = cls(tokens=_unarray(obj.get("tokens"), "int32", "tokens"),
                logprobs=_unarray(obj.get("logprobs"), "float32", "logprobs"),
                mask=_unarray(obj.get("mask"), "uint8", "mask"),
                versions=_unarray(obj.get("versions"), "int32", "versions"),
                reward=float(_get(obj, "reward", (int, float), what)),
                turns=_get(obj, "turns", int, what),
                finish_reason=_get(obj, "finish_reason", str, what))
        n = t.tokens.shape[0]
        if not (t.logprobs.shape[0] == t.mask.shape[0] == t.versions.shape[0] == n):
            raise WireError(f"{what}: tokens, logprobs, mask and versions differ in length")
        if n == 0 or t.tokens.min() < 0:
            raise WireError(f"{what}: empty, or negative token ids")
        # min/max are NaN when any element is: one pass each, and NaN fails every comparison
        if not math.isfinite(t.reward) or not (np.isfinite(t.logprobs.min()) and t.logprobs.max() <= 1e-3):
            raise WireError(f"{what}: reward or log-probs are not finite log-probabilities")
        if t.mask.max() > 1 or t.turns < 0 or t.finish_reason not in FINISH_REASONS:
            raise WireError(f"{what}: mask not 0/1, negative turns, or unknown finish reason")
        return t


@dataclass
class Group:
    """G trajectories of the same task: the unit actors push and replay stores."""

    group_id: str
    task: str
    trajectories: list[Trajectory]
    actor: str = ""
    meta: dict[str, float] = field(default_factory=dict)

    @property
    def version(self) -> int:
        return min(t.version for t in self.trajectories)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([t.reward for t in self.trajectories], dtype=np.float32)

    def to_wire(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "task": self.task, "actor": self.actor,
                "meta": {k: float(v) for k, v in self.meta.items()},
                "trajectories": [t.to_wire() for t in self.trajectories]}

    @classmethod
    def from_wire(cls, obj: Any) -> Group:
        what = "group"
        if not isinstance(obj, dict):
            raise WireError(f"{what}: expected a map")
        trajs = _get(obj, "trajectories", list, what)
        if not trajs or len(trajs) > 4096:
            raise WireError(f"{what}: needs 1 to 4096 trajectories, got {len(trajs)}")
        meta = obj.get("meta", {})
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                 for k, v in meta.items()):
            raise WireError(f"{what}: meta must map names to numbers")
        gid = _get(obj, "group_id", str, what)
        if not 0 < len(gid) <= 128:
            raise WireError(f"{what}: group_id must be 1 to 128 characters")
        return cls(group_id=gid, task=_get(obj, "task", str, what)[:256],
                   trajectories=[Trajectory.from_wire(t) for t in trajs],
                   actor=str(obj.get("actor", ""))[:128], meta=dict(meta))


MAC_BYTES = 32


def sign(key: bytes | None, body: bytes) -> bytes:
    """Prefix `body` with its HMAC-SHA256 under `key` (no-op without a key)."""
    return body if key is None else hmac.new(key, body, hashlib.sha256).digest() + body


def verify(key: bytes | None, frame: bytes) -> bytes:
    """The body of a signed frame; WireError if the MAC is missing or wrong."""
    if key is None:
        return frame
    if len(frame) < MAC_BYTES or not hmac.compare_digest(
            frame[:MAC_BYTES], hmac.new(key, frame[MAC_BYTES:], hashlib.sha256).digest()):
        raise WireError("frame is unsigned or its HMAC does not match")
    return frame[MAC_BYTES:]


def pack(msg_type: str, *, key: bytes | None = None, **fields: Any) -> bytes:
    """One frame: a schema-`SCHEMA` msgpack map, signed when a key is given."""
    return sign(key, msgpack.packb({"v": SCHEMA, "type": msg_type, **fields}, use_bin_type=True))


def _loads(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME,
                               max_str_len=1 << 20, max_array_len=1 << 20, max_map_len=1 << 16)
    except Exception as exc:  # msgpack raises several types for garbage
        raise WireError(f"not a msgpack frame: {type(exc).__name__}") from None


def unpack(frame: bytes, types: tuple[str, ...] | None = None, *, key: bytes | None = None) -> dict[str, Any]:
    """Decode one frame; raise WireError unless it is signed (with a key), within the size
    cap, and a schema-`SCHEMA` map of one of `types`."""
    if len(frame) > MAX_FRAME:
        raise WireError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME}-byte cap")
    obj = _loads(verify(key, frame))
    if not isinstance(obj, dict) or obj.get("v") != SCHEMA or not isinstance(obj.get("type"), str):
        raise WireError(f"not a schema-{SCHEMA} Tandem frame")
    if types is not None and obj["type"] not in types:
        raise WireError(f"unexpected frame type {obj['type']!r}")
    return obj


def _mac(key: bytes, parts: list) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        view = memoryview(part)
        mac.update(len(view).to_bytes(8, "little"))
        mac.update(view)
    return mac.digest()


def pack_parts(msg_type: str, blobs: list = (), *, key: bytes | None = None, **fields: Any) -> list:
    """A multipart message: a header frame (msgpack map) and raw blob frames after it, which
    ZeroMQ sends without copying. With a key, a first frame holds the HMAC-SHA256 of all the others."""
    header = msgpack.packb({"v": SCHEMA, "type": msg_type, "blobs": len(blobs), **fields}, use_bin_type=True)
    parts = [header, *blobs]
    return parts if key is None else [_mac(key, parts), *parts]


def unpack_parts(parts: list, types: tuple[str, ...] | None = None, *,
                 key: bytes | None = None) -> tuple[dict[str, Any], list]:
    """Check and decode a multipart message: (header map, blob frames)."""
    if key is not None:
        if len(parts) < 2 or len(parts[0]) != MAC_BYTES or not hmac.compare_digest(
                bytes(parts[0]), _mac(key, parts[1:])):
            raise WireError("message is unsigned or its HMAC does not match")
        parts = parts[1:]
    if not parts or any(len(p) > MAX_FRAME for p in parts):
        raise WireError(f"empty message, or a frame over the {MAX_FRAME}-byte cap")
    obj = _loads(parts[0])
    if not isinstance(obj, dict) or obj.get("v") != SCHEMA or not isinstance(obj.get("type"), str):
        raise WireError(f"not a schema-{SCHEMA} Tandem message")
    if types is not None and obj["type"] not in types:
        raise WireError(f"unexpected message type {obj['type']!r}")
    if obj.get("blobs") != len(parts) - 1:
        raise WireError("the header's blob count does not match the frames")
    return obj, parts[1:]


def encode_group(group: Group) -> bytes:
    """A group as msgpack bytes: what `push` carries and replay stores and serves unchanged."""
    return msgpack.packb(group.to_wire(), use_bin_type=True)


def decode_group(blob: Any) -> Group:
    """Validate and decode bytes (or a buffer) made by `encode_group`."""
    if not isinstance(blob, (bytes, memoryview)):
        raise WireError("group: expected msgpack bytes")
    return Group.from_wire(_loads(blob))
