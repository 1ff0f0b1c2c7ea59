"""How a version's bytes travel: each transport behind one small interface, for each end.

Two transports carry adapters: signed chunks over the publisher's PUB socket (`SocketSender` /
`SocketReceiver`, weights/chunks.py's format), which reach every host, and a shared-memory file
announced on that socket (`ShmSender` / `ShmReceiver`, weights/shm.py), which reaches the
subscribers on the publisher's host. The control messages (commits, the "latest" request) always
go over the sockets; `transport` chooses which data paths run (`make_senders`, `make_receivers`):

- "shm" (the default): shared memory for subscribers on the publisher's host, the chunks for
  the others. A version that cannot be written to shared memory (no /dev/shm, or no room: a
  container's default is 64 MB) goes over the socket; the publisher logs why, once, and a
  same-host subscriber logs that it fetches it over the socket.
- "socket": the chunks alone (as between hosts).

Every message on the PUB socket starts with its topic (NEWS: commits and announcements, taken by
every subscriber; DATA: chunks, which a subscriber that reads shared memory stops taking).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Literal, Protocol, get_args

from policy.adapter import Adapter
from weights.chunks import Assembly, BrokenAdapter, stream_messages
from weights.format import Pieces
from weights.shm import ShmWriter, host_id, read_shm
from weights.wire import ChunkHeader, Commit, ShmNote, encode

log = logging.getLogger("tandem.weights")

Transport = Literal["shm", "socket"]
TRANSPORTS = get_args(Transport)
NEWS, DATA = b"tandem.adapter.news", b"tandem.adapter.data"
"""Topics of the PUB socket (each message's first frame)."""

Send = Callable[[list], None]
"""Sends one multipart message on the PUB socket (the publisher holds its lock meanwhile)."""


class Sender(Protocol):
    """One data path of the publisher. For each version the publisher calls every sender of its
    transport in turn, shared memory first (its announcement must precede the chunks)::

        for sender in make_senders(transport, send, key):
            sender.send(adapter, blob, chunk_bytes)
        ...
        sender.close()
    """

    def send(self, adapter: Adapter, blob: Pieces, chunk_bytes: int) -> None:
        """Carry `adapter`, whose safetensors bytes are `blob`, to the subscribers it reaches."""

    def close(self) -> None:
        """Release what this path holds (files, kept frames)."""


class SocketSender:
    """The chunks, then the commit, on the PUB socket; keeps the version's frames for "latest"."""

    def __init__(self, send: Send, key: bytes | None) -> None:
        self._send, self.key = send, key
        self.latest: list | None = None
        """Every frame of the newest version (its chunks, then its commit): the "latest" reply."""
        self.commit: bytes | None = None
        """The newest version's commit frame, announced again periodically."""

    def send(self, adapter: Adapter, blob: Pieces, chunk_bytes: int) -> None:
        sent = []
        for parts in stream_messages(blob, adapter.version, adapter.base_model, adapter.config, self.key,
                                     chunk_bytes):
            if len(parts) > 1:
                self._send([DATA, *parts])
                sent.append(parts)
                continue
            # The commit: after every chunk, on the same pipes, so a subscriber that lacks chunks
            # of the committed version has lost them (and asks for "latest": set it first).
            self.latest = [frame for chunk in sent for frame in chunk] + parts
            self.commit = parts[0]
            self._send([NEWS, self.commit])

    def close(self) -> None:
        self.latest = self.commit = None


class ShmSender:
    """Each version written once to a shared-memory file, announced before its chunks. Where the
    file cannot be written, `ShmWriter` logs why (once) and the version goes over the socket."""

    def __init__(self, send: Send, key: bytes | None, host_key: str | None = None) -> None:
        self._send, self.key = send, key
        self.writer = ShmWriter(host=host_key)

    def send(self, adapter: Adapter, blob: Pieces, chunk_bytes: int) -> None:
        name = self.writer.write(blob)
        if name is not None:
            note = ShmNote(version=adapter.version, name=name, size=blob.size, host=self.writer.host,
                           base_model=adapter.base_model, config=adapter.config)
            self._send([NEWS, encode(note, self.key)])

    def close(self) -> None:
        self.writer.close()


def make_senders(transport: str, send: Send, key: bytes | None, host_key: str | None = None) -> list:
    """The publisher's data paths for `transport` (one of TRANSPORTS), in the order they send:
    the last is always the socket's. ValueError for any other."""
    if transport == "socket":
        return [SocketSender(send, key)]
    if transport == "shm":
        return [ShmSender(send, key, host_key), SocketSender(send, key)]
    raise ValueError(f"weight transport {transport!r}: choose one of {TRANSPORTS}")


class Receiver(Protocol):
    """One data path of a subscriber. The subscriber drains its SUB socket, hands each message to
    the path that takes its type, then asks each path, shared memory first, for the newest
    version::

        receiver.take(message, data)                  # for each message of its `takes`
        adapter = receiver.adapter(newest, commit)    # newest version, once it has it whole
        receiver.delivered(adapter.version)           # after any path delivered one
    """

    takes: tuple[type, ...]
    """The message types it reads."""

    def take(self, message, data: list) -> None:
        """Take one message (and the data frames after it). BrokenAdapter is noted, not raised."""

    def adapter(self, newest: int, commit: Commit | None) -> Adapter | None:
        """Version `newest` (whose commit, if it came, is `commit`) once this path has it whole;
        None if not (yet). BrokenAdapter when this path has lost it."""

    def delivered(self, version: int) -> None:
        """`version` was delivered: forget everything not newer."""


class SocketReceiver:
    """The chunks: the newest version's assembly, each chunk hashed as it is taken (while ZeroMQ
    receives the next). Chunks of a version older than one already seen are never hashed."""

    takes = (ChunkHeader,)

    def __init__(self, key: bytes | None, stall_s: float) -> None:
        self.key, self.stall_s = key, stall_s
        self.asm: Assembly | None = None
        self.broken: BrokenAdapter | None = None
        """The newest broken version seen in this drain of the socket (`begin`)."""
        self.version = -1

    @property
    def newest(self) -> int:
        """The newest version whose chunks were seen (-1: none)."""
        return max(self.asm.version if self.asm else -1, self.broken.version if self.broken else -1)

    def begin(self) -> None:
        """A new drain of the socket: what broke before it was dealt with."""
        self.broken = None

    def broke(self, exc: BrokenAdapter) -> None:
        """Note that `exc.version` cannot be rebuilt (the newest such version is kept)."""
        if self.broken is None or exc.version >= self.broken.version:
            self.broken = exc

    def take(self, message: ChunkHeader, data: list) -> None:
        asm, broken = self.asm, self.broken
        try:
            if message.version <= max(self.version, asm.version - 1 if asm else -1, broken.version if broken else -1):
                return  # delivered, superseded, or already broken: never hashed
            if asm is None or asm.version < message.version:
                asm = self.asm = Assembly(message, self.key)
            asm.add(message, data)
            asm.check()
        except BrokenAdapter as exc:
            self.broke(exc)

    def adapter(self, newest: int, commit: Commit | None) -> Adapter | None:
        broken, asm = self.broken, self.asm
        if broken is not None and broken.version == newest:
            raise broken
        if asm is not None and asm.version == newest:
            asm.check()
            if commit is not None:
                asm.seal(commit)
            if asm.ready:
                base_model, config, tensors = asm.finish()
                return Adapter(newest, base_model, config, tensors)
        lost = f"chunks {asm.missing()} of {asm.count}" if asm is not None and asm.version == newest else "its chunks"
        if commit is not None:  # commits follow every chunk of their version
            raise BrokenAdapter(newest, f"the publisher committed it, but {lost} were dropped on the way")
        if asm is not None and time.monotonic() - asm.updated > self.stall_s:
            lost = "its commit" if asm.complete else lost
            raise BrokenAdapter(newest, f"{lost} did not arrive within {self.stall_s:g} s of the last chunk")
        return None

    def delivered(self, version: int) -> None:
        self.version = max(self.version, version)
        if self.asm is not None and self.asm.version <= version:
            self.asm = None

    def reset(self) -> None:
        """Drop the partial version (it is fetched whole by "latest")."""
        self.asm = self.broken = None


class ShmReceiver:
    """The announced shared-memory files: read where this subscriber is on the publisher's host
    (then `unsubscribe` stops the chunks of later versions crossing its socket)."""

    takes = (ShmNote,)

    def __init__(self, host_key: str | None, unsubscribe: Callable[[], None]) -> None:
        self.host = host_key or host_id()
        self._unsubscribe = unsubscribe
        self.note: ShmNote | None = None
        self.version = -1
        self.local = False
        """Whether adapters come from shared memory (this subscriber is on the publisher's host)."""

    def take(self, message: ShmNote, data: list) -> None:
        self.note = message

    def adapter(self, newest: int, commit: Commit | None) -> Adapter | None:
        """The announced version, if it is at least `newest`; None if this subscriber is not on the
        publisher's host (or the file is gone: then the chunks, or "latest", bring it)."""
        note, self.note = self.note, None
        if note is None or note.version <= self.version or note.version < newest or note.host != self.host:
            return None
        try:
            tensors = read_shm(note.name, note.size)
        except OSError:
            return None
        except ValueError as exc:
            raise BrokenAdapter(note.version, f"its shared-memory file cannot be read ({exc})") from None
        if not self.local:
            self.local = True
            self._unsubscribe()
        return Adapter(note.version, note.base_model, note.config, tensors)

    def delivered(self, version: int) -> None:
        self.version = max(self.version, version)


def make_receivers(transport: str, key: bytes | None, stall_s: float, host_key: str | None,
                   unsubscribe: Callable[[], None]) -> list:
    """A subscriber's data paths for `transport` (one of TRANSPORTS), shared memory first: the
    last is always the socket's. ValueError for any other."""
    socket = SocketReceiver(key, stall_s)
    if transport == "socket":
        return [socket]
    if transport == "shm":
        return [ShmReceiver(host_key, unsubscribe), socket]
    raise ValueError(f"weight transport {transport!r}: choose one of {TRANSPORTS}")
