"""The requests the replay service answers, declared once as typed msgspec Structs.

A request is a `pack_parts` message (replay/wire.py) whose header's `type` selects its
Struct (a tagged union); `decode_request` checks the signature and the frame cap and
decodes it with validation: any field outside its bounds is a `WireError` naming it.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Union

import msgspec

from replay.wire import MAC_BYTES, MAX_FRAME, SCHEMA, Count, Name, WireError, parts_mac

MAX_CREDITS = 4096
"""Most credits one request may ask for."""


class Request(msgspec.Struct, tag_field="type", frozen=True, kw_only=True):
    """A request to the replay service; `type` selects the subclass. Fields the schema does not
    name are ignored (a newer peer may add some)."""

    v: int
    id: int = -1
    blobs: int = 0


class Hello(Request, tag="hello", frozen=True):
    actor: Name
    arena: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    """The actor's shared-memory arena, offered for groups on one host (replay/arena.py)."""
    token: Name | None = None
    host: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class Ping(Request, tag="ping", frozen=True):
    pass


class Credit(Request, tag="credit", frozen=True):
    actor: Name
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CREDITS)] = 1


class Push(Request, tag="push", frozen=True):
    shm: tuple[Annotated[str, msgspec.Meta(max_length=128)], Count, Count] | None = None
    """[arena, offset, length] of the group in the actor's arena; None: the group is blob 0."""


class Sample(Request, tag="sample", frozen=True):
    step: Count
    rank: Count
    version: Count
    acked: Annotated[list[tuple[Count, Count]], msgspec.Meta(max_length=64)] = []
    """[step, rank] acks the client sent but has no answer to: consumed by this request."""
    host: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class Ack(Request, tag="ack", frozen=True):
    step: Count
    rank: Count


class Stats(Request, tag="stats", frozen=True):
    pass


REQUESTS = (Hello, Ping, Credit, Push, Sample, Ack, Stats)
_REQUEST = msgspec.msgpack.Decoder(Union[REQUESTS])  # noqa: UP007 (a runtime tuple of types)


class _Id(msgspec.Struct):
    id: int = -1


def decode_request(parts: list, *, key: bytes | None = None) -> tuple[Request, list]:
    """Check and decode a multipart request (`pack_parts`): (the typed request, blob frames).
    WireError for anything outside the schema; its `id` is the request id when one was readable,
    so that the error reply reaches the caller."""
    if key is not None:
        if len(parts) < 2 or len(parts[0]) != MAC_BYTES or not hmac.compare_digest(
                bytes(parts[0]), parts_mac(key, parts[1:])):
            raise WireError("message is unsigned or its HMAC does not match")
        parts = parts[1:]
    if not parts or any(len(p) > MAX_FRAME for p in parts):
        raise WireError(f"empty message, or a frame over the {MAX_FRAME}-byte cap")
    try:
        req = _REQUEST.decode(parts[0])
    except msgspec.MsgspecError as exc:
        error = WireError(f"request outside the schema-{SCHEMA} requests: {exc}")
        try:
            rid = msgspec.msgpack.decode(parts[0], type=_Id).id
        except msgspec.MsgspecError:
            rid = -1
        error.id = rid
        raise error from None
    if req.v != SCHEMA:
        raise WireError(f"not a schema-{SCHEMA} Tandem message")
    if req.blobs != len(parts) - 1:
        raise WireError("the header's blob count does not match the frames")
    return req, parts[1:]
