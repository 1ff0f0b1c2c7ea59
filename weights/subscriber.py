"""The weight channel's actor end: the newest adapter, whole, or a run that stops saying why.

A `WeightSubscriber` drains the publisher's PUB socket into its data paths (weights/transports.py:
chunks, and on the publisher's host shared memory) and keeps the newest version itself (ZeroMQ's
CONFLATE breaks multi-part streams): chunks of a newer version discard an older partial one. It
delivers an adapter once it has every chunk and the commit; one that lacks chunks of the
committed version knows that they were dropped, even all of them, and asks for `latest`; a
partial version that gets no chunk (or no commit) for `stall_s` also counts as dropped (a
publisher that stopped mid-adapter).

Nothing fails silently. A frame that is unsigned, wrongly signed or not our schema is a
stranger's or garbage: it is rejected and counted (`rejected`), and the subscriber goes on. An
adapter from our own publisher that does not arrive whole makes the subscriber ask for `latest`,
a bounded number of times with a timeout; if it still has no good adapter it raises
`AdapterUndeliverable`, which stops the actor and the run with a message that says which
version, why, and what to check.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import zmq

from policy.adapter import Adapter
from weights import wire
from weights.chunks import BrokenAdapter, decode_adapter, read_chunk, read_news, split_messages
from weights.transports import DATA, NEWS, ShmReceiver, SocketReceiver, make_receivers
from weights.wire import Commit, Latest, Nothing, WireError

log = logging.getLogger("tandem.weights")


class AdapterUndeliverable(RuntimeError):
    """An adapter from our own publisher could not be delivered, even by asking for `latest`."""


class WeightSource(Protocol):
    """Where an actor gets adapters.

    Usage::

        adapter = weights.latest(timeout=30)      # at start: the current adapter, if any
        while running:
            if (adapter := weights.poll()) is not None:
                engine.load_adapter(adapter.version, adapter.tensors)
    """

    def poll(self) -> Adapter | None:
        """The newest adapter published since the last call, or None (never blocks)."""

    def wait(self, timeout: float) -> Adapter | None:
        """Like `poll`, but block up to `timeout` seconds for a newer adapter."""

    def latest(self, timeout: float) -> Adapter | None:
        """Ask the publisher for its current adapter (None if it has published none)."""


class WeightSubscriber:
    """An actor's end (also the evaluator's), over ZeroMQ.

    Usage::

        weights = WeightSubscriber(endpoints, key=run_key)
        adapter = weights.latest(timeout=30)          # at start
        adapter = weights.poll() or adapter           # between turns; AdapterUndeliverable stops the run

    `retries` requests for `latest` (each waiting up to `timeout` s) are what it takes, after an
    adapter from our publisher fails to arrive whole, before `AdapterUndeliverable`; a partial
    adapter that gets no new chunk for `stall_s` s has lost its tail; `hwm` is the receive queue
    in chunks (a full queue holds the publisher back, then its own queue drops); `transport` the
    data paths it reads ("shm" also reads shared memory where it is on the publisher's host,
    `host_key` saying which host this is, as the publisher's does; "socket" the chunks alone)."""

    def __init__(self, endpoints: tuple[str, str] | list[str], key: bytes | None = None, *,
                 retries: int = 3, timeout: float = 30.0, stall_s: float = 10.0, hwm: int = 32,
                 transport: str = "shm", host_key: str | None = None) -> None:
        self.key, self.retries, self.timeout, self.stall_s = key, retries, timeout, stall_s
        self._receivers = make_receivers(transport, key, stall_s, host_key,
                                         lambda: self._sub.setsockopt(zmq.UNSUBSCRIBE, DATA))
        self._socket: SocketReceiver = self._receivers[-1]
        self._routes = {kind: r for r in self._receivers for kind in r.takes}
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, NEWS)
        self._sub.setsockopt(zmq.SUBSCRIBE, DATA)
        self._sub.connect(endpoints[0])
        self._endpoints = (endpoints[0], endpoints[1])
        self.version = -1
        """The newest version delivered."""
        self.rejected = 0
        """Frames rejected as a stranger's or garbage (unsigned, wrongly signed, not our schema)."""

    @property
    def local(self) -> bool:
        """Whether adapters come from shared memory (this subscriber is on the publisher's host)."""
        return any(isinstance(r, ShmReceiver) and r.local for r in self._receivers)

    def _deliver(self, adapter: Adapter) -> Adapter | None:
        if adapter.version <= self.version:
            return None
        self.version = adapter.version
        for receiver in self._receivers:
            receiver.delivered(adapter.version)
        return adapter

    def _drain(self) -> dict[int, Commit]:
        """Hand every message waiting on the SUB socket to its data path; the commits seen."""
        commits = {}
        while True:
            try:
                topic, *parts = self._sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return commits
            try:
                if topic.bytes == NEWS and len(parts) == 1:
                    message, data = read_news(parts[0], self.key), []
                elif topic.bytes == DATA:
                    message, data = read_chunk(parts, self.key)
                else:
                    raise WireError(f"a message on topic {topic.bytes[:40]!r} with {len(parts)} more frames")
            except BrokenAdapter as exc:  # ours, but malformed: that version is lost
                self._socket.broke(exc)
                continue
            except WireError:
                self.rejected += 1
                continue
            match message:
                case Commit():
                    commits[message.version] = message
                case _ if type(message) in self._routes:
                    self._routes[type(message)].take(message, data)
                case _:
                    pass  # a valid message for a data path this subscriber does not read

    def _receive(self) -> Adapter | None:
        """The newest version, once one of the data paths has it whole; BrokenAdapter if it cannot
        be rebuilt from what arrived."""
        self._socket.begin()
        commits = self._drain()
        newest = max([*commits, -1, self._socket.newest])
        for receiver in self._receivers[:-1]:  # shared memory, before the socket's chunks
            adapter = receiver.adapter(newest, commits.get(newest))
            if adapter is not None:
                return self._deliver(adapter)
        if newest <= self.version:
            return None
        if self.local and self._socket.newest < newest:
            log.warning("weight channel: version %d is not in shared memory (a write that failed, which the "
                        "publisher logs, or a publisher that has closed); fetching it over the socket", newest)
            return self.latest(self.timeout)
        adapter = self._socket.adapter(newest, commits.get(newest))
        return self._deliver(adapter) if adapter is not None else None

    def poll(self) -> Adapter | None:
        """The newest adapter published since the last call, or None. Never blocks, except to ask
        for `latest` when an adapter did not arrive whole (AdapterUndeliverable if that fails)."""
        try:
            return self._receive()
        except BrokenAdapter as exc:
            self._socket.reset()
            return self._recover(exc)

    def wait(self, timeout: float) -> Adapter | None:
        """Block up to `timeout` seconds for a newer adapter (None if none came)."""
        deadline = time.monotonic() + timeout
        while True:
            adapter = self.poll()
            left = deadline - time.monotonic()
            if adapter is not None or left <= 0:
                return adapter
            asm = self._socket.asm
            if asm is not None:  # wake up in time to notice a stall
                left = min(left, max(0.01, asm.updated + self.stall_s - time.monotonic()))
            self._sub.poll(max(1, int(left * 1000)))

    def _fetch(self, timeout: float) -> tuple[str, Any]:
        """One "latest" request: ("ok", Adapter), ("none", None), or ("timeout" | "stranger" |
        "broken", what went wrong)."""
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self._endpoints[1])
            req.send(wire.encode(Latest(), self.key))
            if not req.poll(int(timeout * 1000)):
                return "timeout", f"no answer to 'latest' within {timeout:g} s"
            parts = req.recv_multipart(copy=False)
        finally:
            req.close(0)
        try:
            if len(parts) == 1:
                wire.decode(parts[0], self.key, (Nothing,))
                return "none", None
            return "ok", decode_adapter(split_messages(parts, self.key), self.key)
        except BrokenAdapter as exc:
            return "broken", exc
        except WireError as exc:
            self.rejected += 1
            return "stranger", f"the 'latest' reply was rejected ({exc})"

    def latest(self, timeout: float) -> Adapter | None:
        """Ask the publisher for its current adapter: None if it has published none, if the answer
        is not newer than `version`, or if none came within `timeout` s (or came from a stranger).
        An adapter of ours that arrives broken is asked for again, up to `retries` times in all,
        then AdapterUndeliverable."""
        broken, reasons = None, []
        for attempt in range(1, self.retries + 1):
            status, got = self._fetch(timeout)
            if status == "ok":
                return self._deliver(got)
            if broken is None and status != "broken":
                return None  # nothing, or no answer: as before, not an error
            broken = got if status == "broken" else broken
            reasons.append(self._why(status, got))
            if status == "none":
                break
            time.sleep(min(1.0, 0.1 * 2 ** attempt))
        raise self._undeliverable(broken.version, reasons, attempt)

    def _recover(self, broken: BrokenAdapter) -> Adapter | None:
        """`broken` came from our publisher: ask for `latest` until an adapter at least as new
        arrives whole, `retries` times at most, then AdapterUndeliverable."""
        reasons = [broken.reason]
        for attempt in range(1, self.retries + 1):
            status, got = self._fetch(self.timeout)
            if status == "ok" and got.version >= broken.version:
                return self._deliver(got)
            reasons.append(self._why(status, got))
            time.sleep(min(1.0, 0.1 * 2 ** attempt))
        raise self._undeliverable(broken.version, reasons, self.retries)

    @staticmethod
    def _why(status: str, got) -> str:
        if status == "ok":
            return f"'latest' answered with the older version {got.version}"
        if status == "none":
            return "'latest' answered that nothing is published"
        return f"'latest' answered with it, but {got.reason}" if status == "broken" else got

    def _undeliverable(self, version: int, reasons: list[str], asked: int) -> AdapterUndeliverable:
        return AdapterUndeliverable(
            f"adapter version {version} from the weight publisher at {self._endpoints[0]} / {self._endpoints[1]} "
            f"could not be delivered (this subscriber has version {self.version}; it asked for 'latest' {asked} "
            f"times): {'; '.join(reasons)}. Check that the learner (rank 0) is alive and publishing, that "
            "only one learner publishes there, that every part runs the same Tandem version with the same run "
            "key, and that the network between them neither drops nor alters data.")

    def close(self) -> None:
        """Close the socket."""
        self._sub.close(0)
