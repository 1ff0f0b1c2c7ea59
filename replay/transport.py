"""How an actor's groups reach replay: as bytes on the socket, or on one host through
the actor's shared-memory arena (replay/arena.py). One small interface, two paths,
chosen by `make_group_path` from the arena's size; the actor client never branches on it.

Usage::

    path = make_group_path(arena_bytes, arena_dir, host)
    hello(**path.offer())              # replay says whether it opened the arena
    path.accepted(reply_arena)
    item = path.item(group)            # a blob, or an [arena, offset, length] reference
    ... push item; once acknowledged (or refused) it is done with ...
    blob = path.as_bytes(item)         # replay could not use a reference: send these instead
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from replay.arena import Arena
from replay.wire import Group, encode_group


class GroupPath(Protocol):
    """Where an actor's pushed groups travel."""

    def offer(self) -> dict:
        """The hello fields that offer replay this path (none for the socket)."""

    def accepted(self, opened: bool) -> None:
        """Replay's answer to the offer: whether it can read groups this way."""

    def item(self, group: Group, pending: Callable[[], set[int]]) -> Any:
        """What to push for `group`: its blob, or a reference to it; `pending()` names the
        extents still awaiting acknowledgement (not to be reused)."""

    def as_bytes(self, ref: list) -> bytes:
        """The bytes a reference names, its extent freed (replay could not read it)."""

    def restarted(self, pending: set[int]) -> None:
        """Replay restarted: every extent but `pending` is free again."""

    def close(self) -> None:
        """Release what the path holds."""


class SocketPath:
    """Every group as bytes on the socket."""

    def offer(self) -> dict:
        return {}

    def accepted(self, opened: bool) -> None:
        pass

    def item(self, group: Group, pending: Callable[[], set[int]]) -> Any:
        return encode_group(group)

    def as_bytes(self, ref: list) -> bytes:
        raise ValueError("the socket path pushes no references")

    def restarted(self, pending: set[int]) -> None:
        pass

    def close(self) -> None:
        pass


class ArenaPath:
    """Groups written into this actor's arena, replay reading them in place; bytes on the
    socket while replay has not opened the arena, or when it is full."""

    def __init__(self, arena_bytes: int, arena_dir: str, host: str) -> None:
        self.size, self.dir, self.host = arena_bytes, arena_dir, host
        self.arena: Arena | None = None
        self.shared = False  # replay opened the arena

    def offer(self) -> dict:
        if self.arena is None:
            self.arena = Arena.create(self.size, self.dir)
        return {"arena": self.arena.name, "token": self.arena.token, "host": self.host}

    def accepted(self, opened: bool) -> None:
        self.shared = opened

    def item(self, group: Group, pending: Callable[[], set[int]]) -> Any:
        if not self.shared:
            return encode_group(group)
        where = []

        def alloc(size: int):
            extent = self.arena.alloc(size, keep=pending)
            if extent is None:
                return None  # full, or too big: this one goes on the socket
            where.extend((extent[0], size))
            return extent[1]

        try:
            blob = encode_group(group, alloc)
        except BaseException:
            if where:
                self.arena.free(where[0])  # never pushed: the extent is this actor's again
            raise
        return [self.arena.name, *where] if where else blob

    def as_bytes(self, ref: list) -> bytes:
        blob = bytes(self.arena.view(ref[1], ref[2]))
        self.arena.free(ref[1])
        return blob

    def restarted(self, pending: set[int]) -> None:
        if self.arena is not None:  # its references to our arena died with it
            self.arena.free_all_but(pending)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena, self.shared = None, False


def make_group_path(arena_bytes: int, arena_dir: str, host: str | None) -> GroupPath:
    """The arena path where this actor has one (`arena_bytes` > 0 and a host), else the socket."""
    if arena_bytes < 0:
        raise ValueError(f"arena_bytes={arena_bytes}: must be 0 (socket only) or a size")
    return ArenaPath(arena_bytes, arena_dir, host) if arena_bytes and host else SocketPath()
