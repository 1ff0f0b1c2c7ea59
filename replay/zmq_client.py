"""The replay service's clients over ZeroMQ: one for actors, one for learners.

Both speak to a `ReplayServer` over a DEALER socket through `_ZmqClient`, which
holds what they share: the socket, signing, request ids, reconnecting, and the
server's epoch. A request parked at the server (a credit, a batch) is re-sent
when the epoch changes, i.e. when the replay process was restarted and forgot it.

Delivery (actors): every push is acknowledged, and resent (after reconnecting)
until it is; the group id makes resending idempotent. `push` waits for its ack;
`send` keeps up to `window` pushes in flight and settles their acks as they
come, so an actor never idles on a round trip (`flush` waits for all of them).

On the replay's host an actor writes groups into an arena of `arena_bytes` in
`arena_dir` and a learner reads them there (replay/arena.py); `arena_bytes=0`
sends everything on the socket. "The replay's host" is `host` where the
launcher gives one (its Ray node: two Ray nodes on one machine are two hosts),
else this machine's boot id.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import zmq

from replay.arena import ARENA_DIR, Arena, ArenaReader, host_id
from replay.client import ReplayUnavailable
from replay.messages import Acked, AckedMany, Batch, Granted, Ok, Refused, Reply, decode_reply
from replay.transport import make_group_path
from replay.wire import Group, WireError, decode_group, pack_parts
log = logging.getLogger("tandem.replay")


class _ZmqClient:
    """The socket, signing, request ids and restarts both sides share. One client per thread
    (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, endpoint: str, key: bytes | None = None, timeout: float = 30.0,
                 check_every: float = 5.0, arena_bytes: int = 64 << 20, arena_dir: str = ARENA_DIR,
                 host: str | None = None) -> None:
        self.endpoint, self.key, self.timeout, self.check_every = endpoint, key, timeout, check_every
        # Which host this is (`host`: the launcher's Ray node; else this machine's boot id); None:
        # every group goes on the socket.
        self.host = (host or host_id()) if arena_bytes > 0 else None
        self._arena_size, self._arena_dir = arena_bytes, arena_dir
        self._ctx = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._epoch: str | None = None
        self._heard = time.monotonic()
        self._connect()

    def _connect(self) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)

    def close(self) -> None:
        self._sock.close(0)

    def _send(self, msg_type: str, blobs: list = (), **fields) -> int:
        rid = next(self._ids)
        self._sock.send_multipart(pack_parts(msg_type, blobs, key=self.key, id=rid, **fields), copy=False)
        return rid

    def _recv(self, timeout: float) -> tuple[Reply, list] | None:
        """The next reply and its blob frames, or None after `timeout` seconds."""
        if not self._sock.poll(int(timeout * 1000)):
            return None
        msg, blobs = decode_reply(self._sock.recv_multipart(copy=False), key=self.key)
        self._heard = time.monotonic()
        if self._epoch is not None and msg.epoch != self._epoch:
            self._restarted()
        self._epoch = msg.epoch
        self._on_reply(msg)
        return msg, blobs

    def _on_reply(self, msg: Reply) -> None:
        """Settle what `msg` answers (a side's own bookkeeping)."""

    def _restarted(self) -> None:
        """The server is a new process: requests parked at the old one are gone."""

    def _call(self, msg_type: str, timeout: float | None, blobs: list = (), **fields) -> tuple[Reply, list]:
        rid = self._send(msg_type, blobs, **fields)
        start = last_check = time.monotonic()
        ping, epoch_before = None, None
        while True:
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise ReplayUnavailable(f"no {msg_type} reply from replay at {self.endpoint} within {timeout:.0f}s")
            if now - last_check > self.check_every:
                # Still parked? Ping: a changed epoch means the server restarted and forgot us.
                ping, epoch_before, last_check = self._send("ping"), self._epoch, now
            got = self._recv(0.5)
            if got is None:
                continue
            msg = got[0]
            if msg.id == rid:
                if isinstance(msg, Refused):
                    raise WireError(f"replay refused the request: {msg.reason}")
                return got
            if msg.id == ping and ping is not None:
                if epoch_before is None or msg.epoch != epoch_before:
                    # A new server (or one never heard from): ask again. Every request is
                    # idempotent: a batch stays assigned, a push is deduplicated by group id.
                    rid = self._send(msg_type, blobs, **fields)
                ping = None

    def stats(self) -> dict:
        return self._call("stats", self.timeout)[0].stats


class ZmqActorReplay(_ZmqClient):
    """The actor's side (`ActorReplay`) over ZeroMQ. Same host: groups go through this actor's
    shared-memory arena when replay opens it, else as bytes on the socket."""

    def __init__(self, endpoint: str, actor: str, key: bytes | None = None, timeout: float = 30.0,
                 check_every: float = 5.0, window: int = 8, arena_bytes: int = 64 << 20,
                 arena_dir: str = ARENA_DIR, host: str | None = None) -> None:
        if not actor:
            raise ValueError("an actor client needs the actor's name")
        self.actor, self.window = actor, window
        self._unacked: dict[int, tuple[Any, float]] = {}  # request id -> (blob or arena reference, sent at)
        self.statuses: dict[str, int] = {}
        """Acknowledged sends by status ("stored", "duplicate", "filtered", or "refused": the
        server found the group malformed)."""
        self.last_status = ""
        self._granted: list[int] = []
        self._asked = 0  # credits requested and not yet granted
        self._to_ask = 0  # of those, not yet sent to the server
        super().__init__(endpoint, key, timeout, check_every, arena_bytes, arena_dir, host)
        self._path = make_group_path(arena_bytes, arena_dir, self.host)

    @property
    def _shared(self) -> bool:
        """Pushes go through the arena (replay opened it)."""
        return getattr(self._path, "shared", False)

    @property
    def _arena(self) -> Arena | None:
        return getattr(self._path, "arena", None)

    def close(self) -> None:
        super().close()
        self._path.close()

    def _on_reply(self, msg: Reply) -> None:
        match msg:
            case Granted(versions=versions):
                self._granted += versions
                self._asked = max(self._asked - len(versions), 0)
            case Ok(arena=False, reason=reason) if self._shared:
                log.info("replay cannot open this actor's arena (%s): groups go on the socket", reason)
                self._path.accepted(False)
            case AckedMany(acks=acks):  # several pushes written to replay's log together
                for rid, status in acks:
                    if rid in self._unacked:
                        del self._unacked[rid]
                        self._count(status)
            case Acked(id=rid, status=status) if rid in self._unacked:
                self._unacked.pop(rid)
                self._count(status)
            case Refused(id=rid, reason=reason) if rid in self._unacked:
                item, _ = self._unacked.pop(rid)
                if isinstance(item, list) and reason.startswith("arena:"):
                    self._push_bytes(item)  # replay could not use the reference: send the bytes instead
                    return
                log.warning("replay refused a group: %s", reason)  # malformed: resending cannot help
                self._count("refused")

    def _count(self, status: str) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.last_status = status

    def _restarted(self) -> None:
        self._path.restarted(self._pending_extents())
        self._send("hello", actor=self.actor, **self._path.offer())
        self._to_ask = self._asked  # every credit still wanted, in one request
        self._resend()

    def _resend(self) -> None:
        """Send every unacknowledged group again (new request ids; the group id dedupes)."""
        pending, self._unacked = list(self._unacked.values()), {}
        for item, _ in pending:
            self._push_item(item)

    def _push_item(self, item) -> None:
        """Send a push: a blob, or an [arena, offset, length] reference to one."""
        rid = self._send("push", shm=item) if isinstance(item, list) else self._send("push", [item])
        self._unacked[rid] = (item, time.monotonic())

    def _push_bytes(self, ref: list) -> None:
        """Send the bytes of an arena push again, on the socket, and free its extent."""
        self._push_item(self._path.as_bytes(ref))

    def _pending_extents(self) -> set[int]:
        return {item[1] for item, _ in self._unacked.values() if isinstance(item, list)}

    def _encode(self, group: Group):
        """The push item for `group`: a reference into the arena when replay reads it, else bytes."""
        group.actor = group.actor or self.actor
        return self._path.item(group, self._pending_extents)

    def hello(self) -> None:
        reply = self._call("hello", self.timeout, actor=self.actor, **self._path.offer())[0]
        self._path.accepted(isinstance(reply, Ok) and reply.arena is True)
        if self._arena is not None and not self._shared:
            log.info("replay cannot open this actor's arena (%s): groups go on the socket",
                     getattr(reply, "reason", None))

    def request_credit(self) -> None:
        self._asked += 1
        self._to_ask += 1  # sent by the next `credits`, together with any others asked for by then

    def credits(self, timeout: float) -> list[int]:
        if self._to_ask:
            self._send("credit", actor=self.actor, n=self._to_ask)
            self._to_ask = 0
        if not self._granted:
            if self._recv(timeout) is None and self._asked and time.monotonic() - self._heard > self.check_every:
                self._heard = time.monotonic()
                self._send("ping")  # a restarted server shows a new epoch in its reply
            while self._recv(0) is not None:
                pass
        out, self._granted = self._granted, []
        return out

    def push(self, group: Group) -> str:
        """Send `group` and wait for its acknowledgement (resending, reconnecting, as needed)."""
        self.flush()  # earlier sends first, so the status read below is this group's
        self.send(group)
        self.flush()
        return self.last_status

    def send(self, group: Group) -> None:
        self._push_item(self._encode(group))
        while self._recv(0) is not None:  # settle whatever has come back
            pass
        while len(self._unacked) >= self.window:
            self._settle()

    def flush(self, timeout: float | None = None) -> None:
        start = time.monotonic()
        while self._unacked:
            if timeout is not None and time.monotonic() - start > timeout:
                raise ReplayUnavailable(f"{len(self._unacked)} pushes not acknowledged within {timeout:.0f}s")
            self._settle()

    def _settle(self) -> None:
        """Wait briefly for acknowledgements; past `timeout` without one, reconnect and resend."""
        if self._recv(0.5) is None and self._unacked:
            oldest = min(sent for _, sent in self._unacked.values())
            if time.monotonic() - oldest > self.timeout:
                # Lost frames or a dead server: reconnect and resend; group ids make it idempotent.
                self._sock.close(0)
                self._connect()
                self._resend()


class ZmqLearnerReplay(_ZmqClient):
    """The learner's side (`LearnerReplay`) over ZeroMQ. Same host: groups pushed through an
    actor's arena are read there in place (validated by replay, held by it until `ack`)."""

    def __init__(self, endpoint: str, key: bytes | None = None, timeout: float = 30.0,
                 check_every: float = 5.0, arena_bytes: int = 64 << 20, arena_dir: str = ARENA_DIR,
                 host: str | None = None) -> None:
        super().__init__(endpoint, key, timeout, check_every, arena_bytes, arena_dir, host)
        self._reader = ArenaReader(arena_dir) if self.host else None
        self._unreadable = 0
        self._acks: dict[int, tuple[int, int]] = {}  # request id -> (step, rank) of acks not yet answered

    def _on_reply(self, msg: Reply) -> None:
        if msg.id in self._acks:
            del self._acks[msg.id]
            if isinstance(msg, Refused):
                log.warning("replay refused an ack: %s", msg.reason)

    def _restarted(self) -> None:
        """Send every unanswered ack again (new request ids; acking a shard twice consumes it once):
        a recovered server consumes these shards, not releases them."""
        pending, self._acks = list(self._acks.values()), {}
        for step, rank in dict.fromkeys(pending):
            self._acks[self._send("ack", step=step, rank=rank)] = (step, rank)

    def sample(self, step: int, rank: int, version: int, timeout: float | None = None,
               by_reference: bool = True) -> list[Group]:
        host = self.host if self._reader is not None and by_reference else None
        # Unanswered acks go with the request, so that replay consumes those shards before it
        # looks at this one, even if the acks themselves were lost with a replay restart.
        acked = list(dict.fromkeys(self._acks.values()))[-64:]
        msg, blobs = self._call("sample", timeout, step=step, rank=rank, version=version, host=host,
                                acked=[list(a) for a in acked])
        self._acks = {rid: a for rid, a in self._acks.items() if a not in acked}  # replay has them
        if not isinstance(msg, Batch):
            raise WireError(f"sample: expected a batch, got a {type(msg).__name__} reply")
        refs = msg.refs
        if refs is None:
            return [decode_group(memoryview(g)) for g in blobs]
        if sum(r is None for r in refs) != len(blobs):
            raise WireError("batch: references do not match the frames")
        groups, frames = [], iter(blobs)
        try:  # arena blobs are read in place: replay validated them, and holds them until `ack`
            for ref in refs:
                groups.append(decode_group(memoryview(next(frames))) if ref is None
                              else decode_group(self._reader.view(ref), checked=True))
        except WireError as exc:
            if not str(exc).startswith("arena:"):
                raise
            # An arena this learner cannot open (its actor exited, or another /dev/shm): the
            # shard stays assigned, so ask for the same one as bytes. Three times in a row: stop asking.
            self._unreadable += 1
            log.info("cannot read an actor's arena (%s): this batch comes on the socket", exc)
            if self._unreadable >= 3:
                self._reader = None
            return self.sample(step, rank, version, timeout, by_reference=False)
        if self._reader is not None and any(refs):
            self._unreadable = 0
            self._reader.forget_closed()  # arenas of actors that have gone
        return groups

    def ack(self, step: int, rank: int, wait: bool = True) -> None:
        if wait:
            self._call("ack", self.timeout, step=step, rank=rank)
        else:  # replies are matched, and errors reported, as they arrive; resent after a restart
            self._acks[self._send("ack", step=step, rank=rank)] = (step, rank)
