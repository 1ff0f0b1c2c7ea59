"""The weight channel's wire messages, declared once as msgspec Structs with bounds.

Every control frame is a signed msgpack map `{"v": SCHEMA, "type": <tag>, ...fields}`: a chunk's
header, a version's commit, a shared-memory announcement, and the "latest" request and its empty
answer. msgspec decodes a frame straight into its Struct and checks every type and bound; the
checks between fields (an index below its count) are the reader's (weights/chunks.py). Nothing
is pickled. The chunk data itself is raw bytes in frames of its own, never inside a map.

What a failure means: a frame that is unsigned, wrongly signed, not msgpack or of no type of
ours is a stranger's or garbage (`WireError`). One that is signed and of our type but breaks
the schema comes from our own publisher; `decode` says so with `Malformed` (a WireError that
carries the version, when the frame has a valid one), and the reader turns it into a
`BrokenAdapter`, which the subscriber must not swallow.

Signing (HMAC-SHA256 of the body, prefixed) and `advertised` are the same as replay/wire.py's;
the weight channel keeps its own copy so that weights/ imports no other part.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Any, Literal, Union

import msgspec

SCHEMA = 1
MAX_FRAME = 64 << 20
"""Frames larger than this are rejected before decoding (64 MiB); no chunk's data exceeds it."""
MAC_BYTES = 32
DIGEST = 32
"""Bytes of a BLAKE3 MAC or digest."""

Version = Annotated[int, msgspec.Meta(ge=0, le=(1 << 53))]
Count = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 44)]
Mac = Annotated[bytes, msgspec.Meta(min_length=DIGEST, max_length=DIGEST)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Config = Annotated[dict[str, Any], msgspec.Meta(max_length=1024)]


class WireError(ValueError):
    """A frame that is not a signed message of the weight channel's schema."""


class Malformed(WireError):
    """A signed frame of one of our types that breaks its schema: our own publisher's, so the
    adapter it belongs to (`version`, or None where even that is unreadable) is broken."""

    def __init__(self, msg_type: str, version: int | None, reason: str) -> None:
        super().__init__(f"{msg_type}: {reason}")
        self.msg_type, self.version, self.reason = msg_type, version, reason


class _Message(msgspec.Struct, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    v: Literal[1] = SCHEMA
    """The schema version; another is not ours."""


class ChunkHeader(_Message, tag="adapter_chunk.v3"):
    """The header of one chunk: its place in the version, and the keyed BLAKE3 of its data
    (which follows in `frames` frames). Chunk 0 also names the base model and the config."""

    version: Version
    index: Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]
    count: Count
    total: Size
    frames: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    mac: Mac
    base_model: Text | None = None
    config: Config | None = None


class Commit(_Message, tag="adapter_commit.v3"):
    """What one version's chunks must add up to: sent after the last, and again periodically."""

    version: Version
    count: Count
    total: Size
    digest: Mac


class ShmNote(_Message, tag="adapter_shm.v3"):
    """A version written to a shared-memory file on the publisher's host (weights/shm.py)."""

    version: Version
    name: Annotated[str, msgspec.Meta(pattern=r"^tandem-weights-\d{1,10}-[0-9a-f]{16}$")]
    size: Size
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    base_model: Text
    config: Config


class Latest(_Message, tag="latest"):
    """A subscriber's request for the current adapter (answered with its chunks and commit)."""


class Nothing(_Message, tag="none"):
    """The answer to `Latest` when nothing is published yet."""


Message = Union[ChunkHeader, Commit, ShmNote, Latest, Nothing]
TYPES = {cls.__struct_config__.tag: cls for cls in (ChunkHeader, Commit, ShmNote, Latest, Nothing)}
OLD_TYPES = {"adapter_chunk": 1, "adapter_head": 1, "adapter_chunk.v2": 2, "adapter_commit.v2": 2}
"""Types of older formats of ours, refused by name (weights/chunks.py)."""


class _Envelope(msgspec.Struct):
    """What any frame of ours holds, whatever its type: read when a frame fails its schema."""

    v: Literal[1]
    type: str
    version: Version | None = None


_decoder = msgspec.msgpack.Decoder(Message)
_envelope = msgspec.msgpack.Decoder(_Envelope)
_encoder = msgspec.msgpack.Encoder()


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


def encode(message: Message, key: bytes | None = None) -> bytes:
    """One frame holding `message`, signed when a key is given."""
    return sign(key, _encoder.encode(message))


def decode(frame, key: bytes | None = None, expect: tuple[type, ...] | None = None) -> Message:
    """The message in one frame (bytes, a buffer or a zmq.Frame), of one of the `expect` types
    (any of ours by default). WireError for a stranger's or garbage; `Malformed` for a signed frame
    of our type (or of an older format of ours, OLD_TYPES) that breaks its schema."""
    body = bytes(frame.buffer if hasattr(frame, "buffer") else frame)
    if len(body) > MAX_FRAME:
        raise WireError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte cap")
    body = verify(key, body)
    try:
        message = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        head = _peek(body)
        if head is None or head.type not in (*TYPES, *OLD_TYPES):
            raise WireError(f"not a schema-{SCHEMA} weight-channel frame ({exc})") from None
        raise Malformed(head.type, head.version, str(exc)) from None
    if expect is not None and not isinstance(message, expect):
        raise WireError(f"unexpected frame type {type(message).__struct_config__.tag!r}")
    return message


def _peek(body: bytes) -> _Envelope | None:
    try:
        return _envelope.decode(body)
    except msgspec.DecodeError:
        return None


def advertised(endpoint: str, address: str | None) -> str:
    """`endpoint` as others reach it: its host replaced by `address` ("tcp://0.0.0.0:5555" bound on
    every interface is reached at one of the node's addresses); unchanged for None."""
    if address is None:
        return endpoint
    scheme, _, rest = endpoint.partition("://")
    return f"{scheme}://{address}:{rest.rpartition(':')[2]}"
