"""Clients of the replay service, for actors and for learners.

Two small protocols mark the process boundary; `ZmqReplayClient` speaks to a
`ReplayServer` over a DEALER socket and `LocalReplay` drives a `ReplayBuffer`
in the same process (tests, debugging, a single-process run).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Protocol

import zmq

from replay.buffer import ReplayBuffer
from replay.wire import Group, WireError, pack, unpack


class ReplayUnavailable(RuntimeError):
    """The replay service did not answer in time."""


class ActorReplay(Protocol):
    """The actor's side.

    Usage::

        replay.hello()
        replay.request_credit()                 # one per group the actor wants to start
        for version in replay.credits(timeout=1.0):
            ...generate a group with an adapter of at least `version`...
            replay.push(group)                  # blocks until acknowledged
    """

    def hello(self) -> None:
        """Announce (re)start: credits this actor held before are released."""

    def request_credit(self) -> None:
        """Ask for one generation credit; it arrives later through `credits`."""

    def credits(self, timeout: float) -> list[int]:
        """Credits granted since the last call (their learner versions); waits up to `timeout` for one."""

    def push(self, group: Group) -> str:
        """Store `group`; returns "stored" or "duplicate". Retries until acknowledged."""


class LearnerReplay(Protocol):
    """The learner's side.

    Usage::

        for step in range(steps):
            groups = replay.sample(step, rank, version)   # this rank's shard of the step's batch
            ...train, publish adapter version + 1...
    """

    def sample(self, step: int, rank: int, version: int, timeout: float | None = None) -> list[Group]:
        """Block until step `step`'s batch is ready; return rank `rank`'s disjoint shard of it."""

    def stats(self) -> dict:
        """Counters of the service (queue depth, groups in/out/dropped, staleness, credit waits)."""


class ZmqReplayClient:
    """Both sides over ZeroMQ. One client per thread (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, endpoint: str, actor: str = "", timeout: float = 30.0) -> None:
        self.endpoint, self.actor, self.timeout = endpoint, actor, timeout
        self._ctx = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._granted: list[int] = []
        self._connect()

    def _connect(self) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)

    def close(self) -> None:
        self._sock.close(0)

    def _send(self, msg_type: str, **fields) -> int:
        rid = next(self._ids)
        self._sock.send(pack(msg_type, id=rid, **fields))
        return rid

    def _recv(self, timeout: float) -> dict | None:
        if not self._sock.poll(int(timeout * 1000)):
            return None
        msg = unpack(self._sock.recv(), ("ok", "credit", "ack", "batch", "stats", "error"))
        if msg["type"] == "credit":
            self._granted.append(int(msg["version"]))
        return msg

    def _call(self, rid: int, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise ReplayUnavailable(f"no reply from replay at {self.endpoint} within {timeout:.0f}s")
            msg = self._recv(min(left, 1.0))
            if msg is None or msg.get("id") != rid:
                continue
            if msg["type"] == "error":
                raise WireError(f"replay refused the request: {msg.get('reason')}")
            return msg

    # -- actor side ---------------------------------------------------------
    def hello(self) -> None:
        self._call(self._send("hello", actor=self.actor), self.timeout)

    def request_credit(self) -> None:
        self._send("credit", actor=self.actor)

    def credits(self, timeout: float) -> list[int]:
        if not self._granted:
            self._recv(timeout)
            while self._recv(0) is not None:
                pass
        out, self._granted = self._granted, []
        return out

    def push(self, group: Group) -> str:
        group.actor = group.actor or self.actor
        payload = group.to_wire()
        for attempt in range(1000):
            try:
                return self._call(self._send("push", group=payload), self.timeout)["status"]
            except ReplayUnavailable:
                # The server went away or the frame was lost: reconnect and resend; the
                # group id makes the retry idempotent.
                self.close()
                self._connect()
        raise ReplayUnavailable("push was never acknowledged")

    # -- learner side -------------------------------------------------------
    def sample(self, step: int, rank: int, version: int, timeout: float | None = None) -> list[Group]:
        msg = self._call(self._send("sample", step=step, rank=rank, version=version), timeout)
        groups = msg.get("groups")
        if not isinstance(groups, list):
            raise WireError("batch reply without groups")
        return [Group.from_wire(g) for g in groups]

    def stats(self) -> dict:
        return self._call(self._send("stats"), self.timeout)["stats"]


class LocalReplay:
    """Both sides on a ReplayBuffer in this process (thread-safe)."""

    def __init__(self, buffer: ReplayBuffer, actor: str = "local") -> None:
        self.buffer, self.actor = buffer, actor
        self._cond = threading.Condition()
        self._wanted = 0
        self._granted: list[int] = []

    def hello(self) -> None:
        with self._cond:
            self.buffer.hello(self.actor)

    def request_credit(self) -> None:
        with self._cond:
            self._wanted += 1

    def credits(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._wanted and (credit := self.buffer.grant(self.actor)) is not None:
                    self._wanted -= 1
                    self._granted.append(credit.version)
                left = deadline - time.monotonic()
                if self._granted or left <= 0:
                    out, self._granted = self._granted, []
                    return out
                self._cond.wait(left)

    def push(self, group: Group) -> str:
        group.actor = group.actor or self.actor
        with self._cond:
            status = self.buffer.push(group)
            self._cond.notify_all()
            return status

    def sample(self, step: int, rank: int, version: int, timeout: float | None = None) -> list[Group]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self.buffer.set_version(version)
            self._cond.notify_all()
            while (shard := self.buffer.take(step, rank)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ReplayUnavailable(f"step {step}'s batch was not ready within {timeout}s")
                self._cond.wait(left)
            return shard

    def stats(self) -> dict:
        with self._cond:
            return self.buffer.snapshot()
