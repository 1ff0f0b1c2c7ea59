"""The replay service's requests and replies, declared once as typed msgspec Structs.

Each is a `pack_parts` message (replay/wire.py) whose header's `type` selects its
Struct (a tagged union); `decode_request` and `decode_reply` check the signature and
the frame cap and decode with validation: any field outside its bounds is a
`WireError` naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from replay.wire import SCHEMA, Count, Name, WireError, verified

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


Ref = tuple[Annotated[str, msgspec.Meta(max_length=128)], Count, Count]
"""[arena, offset, length]: a group in an actor's shared-memory arena (replay/arena.py)."""


class Reply(msgspec.Struct, tag_field="type", frozen=True, kw_only=True):
    """A reply of the replay service; `id` is the request's (-1: none), `epoch` the server
    process's (a new one: it restarted)."""

    v: int
    id: int = -1
    blobs: int = 0
    epoch: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class Ok(Reply, tag="ok", frozen=True):
    arena: bool | None = None
    """To a hello that offered an arena: whether replay opened it."""
    reason: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    consumed: Count | None = None


class Granted(Reply, tag="credit", frozen=True):
    versions: Annotated[list[Count], msgspec.Meta(max_length=MAX_CREDITS)]


class Acked(Reply, tag="ack", frozen=True):
    group_id: Name
    status: Annotated[str, msgspec.Meta(max_length=32)]


class AckedMany(Reply, tag="acks", frozen=True):
    acks: Annotated[list[tuple[int, Annotated[str, msgspec.Meta(max_length=32)]]], msgspec.Meta(max_length=1 << 16)]
    """[request id, status] of several pushes one log write stored, in order."""


class Batch(Reply, tag="batch", frozen=True):
    step: Count
    version: Count
    refs: Annotated[list[Ref | None], msgspec.Meta(max_length=1 << 16)] | None = None
    """Per group: where it lies in an actor's arena, or None for the next blob; None: all blobs."""


class StatsReply(Reply, tag="stats", frozen=True):
    stats: dict[str, Any]


class Refused(Reply, tag="error", frozen=True):
    reason: Annotated[str, msgspec.Meta(max_length=4096)] = ""


_REPLY = msgspec.msgpack.Decoder(Union[Ok, Granted, Acked, AckedMany, Batch, StatsReply, Refused])  # noqa: UP007


def decode_reply(parts: list, *, key: bytes | None = None) -> tuple[Reply, list]:
    """Check and decode a multipart reply: (the typed reply, blob frames); WireError if it is
    outside the schema."""
    return _decode(_REPLY, "reply", parts, key)


def decode_request(parts: list, *, key: bytes | None = None) -> tuple[Request, list]:
    """Check and decode a multipart request (`pack_parts`): (the typed request, blob frames).
    WireError for anything outside the schema; its `id` is the request id when one was readable,
    so that the error reply reaches the caller."""
    return _decode(_REQUEST, "request", parts, key)


def _decode(decoder: msgspec.msgpack.Decoder, what: str, parts: list, key: bytes | None) -> tuple:
    parts = verified(parts, key)
    try:
        req = decoder.decode(parts[0])
    except msgspec.MsgspecError as exc:
        error = WireError(f"{what} outside the schema-{SCHEMA} {what}s: {exc}")
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
