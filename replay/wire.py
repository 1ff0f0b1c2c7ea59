"""Wire types: declared once, encoded as msgpack with arrays as raw bytes.

Every frame is a msgpack map with a schema version `v` and a `type`; arrays
travel as little-endian raw bytes inside group blobs (below). Decoding never
trusts the peer: unknown schema, unknown type, wrong dtype, lengths that do not
match, non-finite rewards or a frame over the size cap all raise `WireError`,
which servers turn into an error reply and a counter. Nothing is pickled.

With a key (the launcher makes one per run), every frame is prefixed with an
HMAC-SHA256 of its body; a frame that is unsigned or tampered with is rejected
before it is decoded.

A group travels as one blob that replay validates, stores and serves exactly as
it arrived, without re-encoding it: a magic, a small msgpack header (ids,
per-trajectory lengths, rewards, turns, finish reasons, image shapes, each turn's state
and reward) and then every trajectory's arrays concatenated field by field as
little-endian raw bytes (tokens, versions, log-probs: 4-byte aligned; then the mask),
then the images' pixels, trajectory by trajectory and image by image, each row-major
H×W×3 uint8 (RGB). A header without image shapes (every blob written before images)
means no images, and one without turn states that they were not recorded. Encoding
is one copy of the arrays and pixels; decoding copies nothing: the arrays and images
are read-only views of the blob (a ZeroMQ frame on the learner), and the checks on
their contents are a few vectorised passes over the whole group (any pixel value is
valid: only the shapes are checked).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import struct
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgpack
import msgspec
import numpy as np

SCHEMA = 1
MAX_FRAME = 64 << 20
"""Frames larger than this are rejected before decoding (64 MiB)."""

MAX_GROUP = 4096
"""Most trajectories in one group."""

MAX_IMAGES = 1024
"""Most images in one trajectory."""

MAX_IMAGE_SIDE = 4096
"""Largest height or width of an image, in pixels (the smallest is 1); a group's pixels count
towards `MAX_FRAME` like its tokens."""

FINISH_REASONS = ("terminated", "truncated", "length", "env_error")
"""terminated/truncated: as the environment said; length: the context limit; env_error: the environment failed."""


class WireError(ValueError):
    """A frame that does not follow the schema."""


Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
Side = Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGE_SIDE)]
ImageShapes = Annotated[list[tuple[Side, Side]], msgspec.Meta(max_length=MAX_IMAGES)]
"""One trajectory's images, as [height, width] each, in the order of their placeholders."""
MAX_TURNS = 1 << 16
"""Most model turns in one trajectory whose states and rewards a group carries."""
Anchors = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]], msgspec.Meta(max_length=MAX_TURNS)]
TurnRewards = Annotated[list[float], msgspec.Meta(max_length=MAX_TURNS)]


class GroupHeader(msgspec.Struct, frozen=True):
    """The msgpack header of a group blob: per-trajectory lists, one entry each."""

    v: int
    group_id: Name
    task: str
    lens: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_GROUP)]
    rewards: Annotated[list[float], msgspec.Meta(max_length=MAX_GROUP)]
    turns: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_GROUP)]
    finish: Annotated[list[Annotated[str, msgspec.Meta(max_length=16)]], msgspec.Meta(max_length=MAX_GROUP)]
    actor: str = ""
    meta: Annotated[dict[str, float], msgspec.Meta(max_length=256)] = {}
    images: Annotated[list[ImageShapes], msgspec.Meta(max_length=MAX_GROUP)] = []
    """Per trajectory, its images' shapes; empty (or absent) when no trajectory has images."""
    anchors: Annotated[list[Anchors], msgspec.Meta(max_length=MAX_GROUP)] = []
    """Per trajectory, each turn's state (`Trajectory.anchors`); empty (or absent): not recorded."""
    turn_rewards: Annotated[list[TurnRewards], msgspec.Meta(max_length=MAX_GROUP)] = []
    """Per trajectory, each turn's reward; present exactly when `anchors` is."""


_GROUP_HEADER = msgspec.msgpack.Decoder(GroupHeader)


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
    images: list = field(default_factory=list)
    """The episode's images in the order their placeholder tokens appear in `tokens`: each a
    uint8 array [H, W, 3] (RGB)."""
    anchors: list[int] = field(default_factory=list)
    """Per model turn, the state it was played from as a 63-bit key (actors/rollout.py `anchor`);
    empty: not recorded (a producer of its own), else one per turn."""
    turn_rewards: list[float] = field(default_factory=list)
    """Per model turn, the environment's reward for it, undiscounted; recorded with `anchors`."""

    @property
    def version(self) -> int:
        """The oldest version among the model's tokens (the trajectory's version); for one without
        model tokens (an environment that failed before the first turn), the oldest of its own
        (its observation tokens carry the version it started under), as `check_group` computes."""
        model = self.versions[self.mask.astype(bool)]
        source = model if model.size else self.versions
        return int(source.min()) if source.size else 0


OUTCOME_SPREAD = "outcome_spread"
"""Key of `Group.meta`: max − min of what the group's episodes achieved (their environments'
rewards undiscounted), which actors send beside the rewards (their returns, discounted under
--actor.turn-discount)."""
GREEDY_PLAYS = "greedy_plays"
"""Key of `Group.meta`: how many of the group's first trajectories were played greedily
(--actor.greedy-play: the first one); absent when none was."""


@dataclass
class Group:
    """G trajectories of the same task: the unit actors push and replay stores."""

    group_id: str
    task: str
    trajectories: list[Trajectory]
    actor: str = ""
    meta: dict[str, float] = field(default_factory=dict)
    _version: int | None = field(default=None, repr=False, compare=False)
    """Set by `check_group`, which computes it for the whole group at once."""
    _arrays: tuple | None = field(default=None, repr=False, compare=False)
    """Set by `read_group`: the whole group's arrays (tokens, versions, log-probs, mask) and where
    each trajectory starts, for `check_group`'s passes."""
    _rewards: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Set by `read_group(..., trajectories=False)`: the rewards, from the header (with
    trajectories, `rewards` reads them, so that a changed trajectory reward is seen)."""

    @property
    def version(self) -> int:
        """The oldest version among the model's tokens of all trajectories."""
        return self._version if self._version is not None else min(t.version for t in self.trajectories)

    @property
    def rewards(self) -> np.ndarray:
        if self._rewards is not None:
            return self._rewards
        return np.array([t.reward for t in self.trajectories], dtype=np.float32)

    @property
    def outcome_spread(self) -> float:
        """max − min of what the episodes achieved: meta's OUTCOME_SPREAD where the actor sent it,
        else the rewards' own (a group without a discount, or from a producer of its own)."""
        spread = self.meta.get(OUTCOME_SPREAD)
        return float(np.ptp(self.rewards)) if spread is None else float(spread)


MAC_BYTES = 32


def advertised(endpoint: str, address: str | None) -> str:
    """`endpoint` as others reach it: its host replaced by `address` ("tcp://0.0.0.0:5555" bound on
    every interface is reached at one of the node's addresses); unchanged for None."""
    if address is None:
        return endpoint
    scheme, _, rest = endpoint.partition("://")
    return f"{scheme}://{address}:{rest.rpartition(':')[2]}"


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


def parts_mac(key: bytes, parts: list) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        view = memoryview(part)
        mac.update(len(view).to_bytes(8, "little"))
        mac.update(view)
    return mac.digest()


_mac = parts_mac  # the name the security tests sign with


def pack_parts(msg_type: str, blobs: list = (), *, key: bytes | None = None, **fields: Any) -> list:
    """A multipart message: a header frame (msgpack map) and raw blob frames after it, which
    ZeroMQ sends without copying. With a key, a first frame holds the HMAC-SHA256 of all the others."""
    header = msgpack.packb({"v": SCHEMA, "type": msg_type, "blobs": len(blobs), **fields}, use_bin_type=True)
    parts = [header, *blobs]
    return parts if key is None else [parts_mac(key, parts), *parts]


def verified(parts: list, key: bytes | None) -> list:
    """A multipart message's frames without its signature, once the HMAC (with a key) and the
    frame cap are checked; WireError otherwise."""
    if key is not None:
        if len(parts) < 2 or len(parts[0]) != MAC_BYTES or not hmac.compare_digest(
                bytes(parts[0]), parts_mac(key, parts[1:])):
            raise WireError("message is unsigned or its HMAC does not match")
        parts = parts[1:]
    if not parts or any(len(p) > MAX_FRAME for p in parts):
        raise WireError(f"empty message, or a frame over the {MAX_FRAME}-byte cap")
    return parts


def unpack_parts(parts: list, types: tuple[str, ...] | None = None, *,
                 key: bytes | None = None) -> tuple[dict[str, Any], list]:
    """Check and decode a multipart message: (header map, blob frames)."""
    parts = verified(parts, key)
    obj = _loads(parts[0])
    if not isinstance(obj, dict) or obj.get("v") != SCHEMA or not isinstance(obj.get("type"), str):
        raise WireError(f"not a schema-{SCHEMA} Tandem message")
    if types is not None and obj["type"] not in types:
        raise WireError(f"unexpected message type {obj['type']!r}")
    if obj.get("blobs") != len(parts) - 1:
        raise WireError("the header's blob count does not match the frames")
    return obj, parts[1:]


GROUP_MAGIC = b"TGRP"
_PREFIX = struct.Struct("<4sI")  # magic, header length
_FIELDS = (("tokens", "<i4"), ("versions", "<i4"), ("logprobs", "<f4"), ("mask", "u1"))
_BYTES_PER_TOKEN = sum(np.dtype(d).itemsize for _, d in _FIELDS)
_NOT_MODEL = 1 << 30  # policy versions are below this


def _payload_start(header_len: int) -> int:
    return (_PREFIX.size + header_len + 7) // 8 * 8


def group_blob(header: dict[str, Any], n_tokens: int, fill=None, alloc=None) -> bytearray | memoryview:
    """A group blob: the prefix, the msgpack `header`, and room for `n_tokens` tokens' arrays and
    the pixels of the images whose shapes `header["images"]` lists, filled by
    `fill(payload_view)` (or zeros). `encode_group` is the usual way to make one.
    `alloc(size)` may supply the memory (a writable buffer, or None for a new bytearray).
    WireError if the blob would exceed the frame cap."""
    head = msgpack.packb(header, use_bin_type=True)
    start = _payload_start(len(head))
    size = start + _BYTES_PER_TOKEN * n_tokens + _pixel_bytes(header.get("images", ()))
    if size > MAX_FRAME:
        raise WireError(f"group of {size} bytes (tokens and images) exceeds the {MAX_FRAME}-byte cap")
    out = alloc(size) if alloc is not None else None
    if out is None:
        out = bytearray(size)
    elif fill is None:
        out[start:] = bytes(size - start)
    _PREFIX.pack_into(out, 0, GROUP_MAGIC, len(head))
    out[_PREFIX.size:_PREFIX.size + len(head)] = head
    out[_PREFIX.size + len(head):start] = bytes(start - _PREFIX.size - len(head))
    if fill is not None:
        fill(memoryview(out)[start:])
    return out


def _pixel_bytes(shapes) -> int:
    """Bytes of the images of per-trajectory [h, w] lists (H×W×3 uint8 each)."""
    return 3 * sum(h * w for traj in shapes for h, w in traj)


def _image_shapes(t: Trajectory, i: int) -> list[tuple[int, int]]:
    """[(h, w), ...] of trajectory `i`'s images; WireError unless each is a uint8 array
    [H, W, 3] within the bounds."""
    if len(t.images) > MAX_IMAGES:
        raise WireError(f"group: trajectory {i} has {len(t.images)} images, more than {MAX_IMAGES}")
    shapes = []
    for j, image in enumerate(t.images):
        if not (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
                and image.shape[2] == 3):
            got = f"{image.dtype} array {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
            raise WireError(f"group: trajectory {i}'s image {j} must be a uint8 array [H, W, 3] (RGB), got {got}")
        h, w = image.shape[:2]
        if not (1 <= h <= MAX_IMAGE_SIDE and 1 <= w <= MAX_IMAGE_SIDE):
            raise WireError(f"group: trajectory {i}'s image {j} is {h}×{w}; each side must be 1 to {MAX_IMAGE_SIDE}")
        shapes.append((int(h), int(w)))
    return shapes


def _images(payload: memoryview, offset: int, shapes) -> list[list[np.ndarray]]:
    """Each trajectory's images: read-only [h, w, 3] views of `payload`, the first at `offset`."""
    out = []
    for traj in shapes:
        views = []
        for h, w in traj:
            views.append(np.frombuffer(payload, np.uint8, count=h * w * 3, offset=offset).reshape(h, w, 3))
            offset += h * w * 3
        out.append(views)
    return out


def group_parts(blob: Any) -> tuple[Any, memoryview]:
    """(decoded header, payload view) of a group blob, checking only the framing."""
    head, payload = _group_frame(blob)
    return _loads(head), payload


def _group_frame(blob: Any) -> tuple[memoryview, memoryview]:
    """(header bytes, payload view) of a group blob, checking only the framing."""
    view = memoryview(blob).cast("B").toreadonly()
    if len(view) > MAX_FRAME:
        raise WireError(f"group of {len(view)} bytes exceeds the {MAX_FRAME}-byte cap")
    if len(view) < _PREFIX.size:
        raise WireError("group: too short to be a Tandem group")
    magic, head_len = _PREFIX.unpack_from(view, 0)
    if magic != GROUP_MAGIC:
        raise WireError("group: not a Tandem group (bad magic)")
    if head_len > min(len(view) - _PREFIX.size, 1 << 20):
        raise WireError("group: header length runs past the frame")
    return view[_PREFIX.size:_PREFIX.size + head_len], view[_payload_start(head_len):]


def encode_group(group: Group, alloc=None) -> bytearray | memoryview:
    """A group as one blob: what `push` carries and replay stores and serves unchanged.
    `alloc(size)` may supply the memory (an actor's shared-memory arena, replay/arena.py).
    WireError for an image that is not a uint8 array [H, W, 3] within the bounds, or a blob
    over the frame cap."""
    trajs = group.trajectories
    lens = [int(np.shape(t.tokens)[0]) for t in trajs]
    shapes = [_image_shapes(t, i) for i, t in enumerate(trajs)]
    header = {"v": SCHEMA, "group_id": group.group_id, "task": group.task, "actor": group.actor,
              "meta": {k: float(v) for k, v in group.meta.items()}, "lens": lens,
              "rewards": [float(t.reward) for t in trajs], "turns": [int(t.turns) for t in trajs],
              "finish": [t.finish_reason for t in trajs]}
    if any(shapes):  # a group without images is written as before images existed
        header["images"] = shapes
    if any(t.anchors for t in trajs):  # so is a group whose turns' states were not recorded
        header["anchors"] = [[int(a) for a in t.anchors] for t in trajs]
        header["turn_rewards"] = [[float(r) for r in t.turn_rewards] for t in trajs]
    n = sum(lens)

    def fill(payload: memoryview) -> None:
        offset = 0
        for name, dtype in _FIELDS:
            dst = np.frombuffer(payload, dtype=dtype, count=n, offset=offset)
            pos = 0
            for t, length in zip(trajs, lens):
                dst[pos:pos + length] = getattr(t, name)
                pos += length
            offset += n * dst.itemsize
        for t, views in zip(trajs, _images(payload, offset, shapes)):
            for dst, image in zip(views, t.images):
                dst[...] = image  # a writable view here: the payload is ours to fill

    return group_blob(header, n, fill, alloc)


def decode_group(blob: Any, checked: bool = False) -> Group:
    """Validate and decode a blob made by `encode_group` (bytes, or a buffer such as a ZeroMQ
    frame): `read_group`, then `check_group`. The trajectories' arrays are read-only views of
    the blob.

    `checked=True` is for a blob replay has already validated in full (a learner reading an
    actor's arena in place): the header and every length are still checked, the passes over
    the arrays' values are skipped, and the group's version is left to be computed on use."""
    group = read_group(blob)
    return group if checked else check_group(group)


def read_group(blob: Any, trajectories: bool = True) -> Group:
    """Decode a group blob, checking its header, every length and every image shape (cheap: no
    pass over the arrays or pixels); `check_group` does the rest. `trajectories=False` leaves
    the trajectory list empty and takes the rewards from the header: the replay server needs
    only the id, actor, rewards, arrays and version, not one object per trajectory (nor its
    images)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)) and not hasattr(blob, "buffer"):
        raise WireError("group: expected a group blob")
    head, payload = _group_frame(getattr(blob, "buffer", blob))
    what = "group"
    try:
        header = _GROUP_HEADER.decode(head)
    except msgspec.MsgspecError as exc:
        raise WireError(f"{what}: header outside the schema-{SCHEMA} group header: {exc}") from None
    if header.v != SCHEMA:
        raise WireError(f"group: not a schema-{SCHEMA} group header")
    gid, lens, rewards, turns, finish = header.group_id, header.lens, header.rewards, header.turns, header.finish
    if not 0 < len(lens) <= MAX_GROUP or min(lens) < 1:
        raise WireError(f"{what}: needs 1 to {MAX_GROUP} trajectories, none empty")
    for name in ("rewards", "turns", "finish"):
        if len(getattr(header, name)) != len(lens):
            raise WireError(f"group: {name!r} has {len(getattr(header, name))} entries for {len(lens)} trajectories")
    if not all(math.isfinite(r) for r in rewards):
        raise WireError(f"{what}: rewards must be finite")
    if not set(finish) <= set(FINISH_REASONS):
        raise WireError(f"{what}: unknown finish reason")
    spread = header.meta.get(OUTCOME_SPREAD, 0.0)
    if not (math.isfinite(spread) and spread >= 0):
        raise WireError(f"{what}: meta {OUTCOME_SPREAD!r} must be a finite spread (>= 0), got {spread}")
    shapes = header.images or [[] for _ in lens]
    if len(shapes) != len(lens):
        raise WireError(f"group: 'images' has {len(shapes)} entries for {len(lens)} trajectories")
    anchors, turn_rewards = _turn_states(header)
    n = sum(lens)
    if len(payload) != _BYTES_PER_TOKEN * n + _pixel_bytes(shapes):
        raise WireError(f"{what}: payload length does not match the trajectory lengths and image shapes")
    arrays, offset = {}, 0
    for name, dtype in _FIELDS:
        arrays[name] = np.frombuffer(payload, dtype=dtype, count=n, offset=offset)
        offset += n * arrays[name].itemsize
    tokens, versions, logprobs, mask = (arrays[k] for k in ("tokens", "versions", "logprobs", "mask"))
    starts = [0, *itertools.accumulate(lens[:-1])]
    trajs = [Trajectory(tokens[s:s + k], logprobs[s:s + k], mask[s:s + k], versions[s:s + k], r, t, f, images,
                        a, tr)
             for s, k, r, t, f, images, a, tr in zip(starts, lens, rewards, turns, finish,
                                                      _images(payload, _BYTES_PER_TOKEN * n, shapes),
                                                      anchors, turn_rewards)
             ] if trajectories else []
    return Group(gid, header.task[:256], trajs, actor=header.actor[:128],
                 meta=dict(header.meta), _arrays=(tokens, versions, logprobs, mask, starts),
                 _rewards=None if trajectories else np.array(rewards, dtype=np.float32))


def _turn_states(header: GroupHeader) -> tuple[list, list]:
    """Each trajectory's (anchors, turn rewards) from the header, empty lists where not recorded;
    WireError unless both are absent or both give one entry per turn, the rewards finite."""
    n = len(header.lens)
    if not header.anchors and not header.turn_rewards:
        return [[] for _ in range(n)], [[] for _ in range(n)]
    if len(header.anchors) != n or len(header.turn_rewards) != n:
        raise WireError(f"group: 'anchors' and 'turn_rewards' need one entry per trajectory ({n}), got "
                        f"{len(header.anchors)} and {len(header.turn_rewards)}")
    for i, (a, r, turns) in enumerate(zip(header.anchors, header.turn_rewards, header.turns)):
        if len(a) != turns or len(r) != turns:
            raise WireError(f"group: trajectory {i} has {turns} turns but {len(a)} anchors and {len(r)} turn rewards")
        if not all(math.isfinite(x) for x in r):
            raise WireError(f"group: trajectory {i}'s turn rewards must be finite")
    return header.anchors, header.turn_rewards


def check_group(group: Group) -> Group:
    """Check the values of a group from `read_group` (token ids, versions, mask, log-probs) in
    a few vectorised passes, and compute its version. WireError if any is out of range."""
    what = "group"
    tokens, versions, logprobs, mask, starts = group._arrays
    # One pass per array. Read as unsigned, a negative int32 is at least 2**31, so one max checks
    # both bounds. A float min/max is NaN when any element is, and NaN fails every comparison.
    if (tokens.view("<u4").max() >= 1 << 31 or mask.max() > 1
            or versions.view("<u4").max() >= _NOT_MODEL):
        raise WireError(f"{what}: negative token ids or versions, or a mask that is not 0/1")
    if not (np.isfinite(logprobs.min()) and logprobs.max() <= 1e-3):
        raise WireError(f"{what}: log-probs are not finite log-probabilities")
    # The group's version (the oldest model token's) in two vectorised passes: tokens outside
    # the mask get a bit above every valid version, so they never win the minimum.
    per_traj = np.minimum.reduceat(versions | ((mask ^ 1).astype(np.int32) << 30), starts)
    if (per_traj >= _NOT_MODEL).any():  # a trajectory without model tokens: its oldest token
        per_traj = np.where(per_traj >= _NOT_MODEL, np.minimum.reduceat(versions, starts), per_traj)
    group._version = int(per_traj.min())
    return group
