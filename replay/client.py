"""Clients of the replay service, for actors and for learners.

Two small protocols mark the process boundary; `ZmqActorReplay` and
`ZmqLearnerReplay` (replay/zmq_client.py) speak to a `ReplayServer` over a
DEALER socket and `LocalReplay` drives a `ReplayBuffer` in the same process
(tests, debugging, a single-process run).

Delivery: every push is acknowledged, and resent (after reconnecting) until it
is; the group id makes resending idempotent. `push` waits for its ack; `send`
keeps up to `window` pushes in flight and settles their acks as they come, so
an actor never idles on a round trip (`flush` waits for all of them). A
request parked at the server (a credit, a batch) is re-sent when the server's
epoch changes, i.e. when the replay process was restarted and forgot it.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from replay.buffer import Entry, ReplayBuffer
from replay.wire import Group, decode_group, encode_group


class ReplayUnavailable(RuntimeError):
    """The replay service did not answer in time."""


class ActorReplay(Protocol):
    """The actor's side.

    Usage::

        replay.hello()
        replay.request_credit()                 # one per group the actor wants to start
        for version in replay.credits(timeout=1.0):
            ...generate a group with an adapter of at least `version`...
            replay.send(group)                  # acknowledged later; resent until it is
        replay.flush()                          # before exiting: every push acknowledged
    """

    def hello(self) -> None:
        """Announce (re)start: credits this actor held before are released."""

    def request_credit(self) -> None:
        """Ask for one generation credit; it arrives later through `credits`."""

    def credits(self, timeout: float) -> list[int]:
        """Credits granted since the last call (their learner versions); waits up to `timeout` for one."""

    def push(self, group: Group) -> str:
        """Store `group`; returns "stored", "duplicate" or "filtered". Retries until acknowledged."""

    def send(self, group: Group) -> None:
        """Store `group` without waiting for its acknowledgement (a bounded number may be pending)."""

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every sent group is acknowledged."""


class LearnerReplay(Protocol):
    """The learner's side.

    Usage::

        for step in range(steps):
            groups = replay.sample(step, rank, version)   # this rank's shard of the step's batch
            ...train, publish adapter version + 1...
            replay.ack(step, rank)                        # consumed: never served again
    """

    def sample(self, step: int, rank: int, version: int, timeout: float | None = None) -> list[Group]:
        """Block until step `step`'s batch is ready; return rank `rank`'s disjoint shard of it
        (the same shard again if asked again before `ack`). The trajectories' arrays are
        read-only views that stay valid until `ack`: copy what must outlive it."""

    def ack(self, step: int, rank: int, wait: bool = True) -> None:
        """The shard of `step` has been trained on: replay consumes it for good. With `wait`,
        return once replay has recorded it (on its log, if it keeps one); without, return at
        once and let the reply come later. Either way the ack is not lost to a replay restart:
        a client resends every unanswered ack to a new replay process, and sends them along
        with its next `sample`, so a recovered replay (one with a log) consumes the shard it
        had restored for this rank rather than serving its groups again. Acknowledging a
        step twice, or one replay does not hold, is harmless.

        Ack a step before a checkpoint that says it was trained: a rank that asks for a later
        step while replay still holds its shard of an earlier one gets that shard released
        (its groups served again), as it would after resuming from an older checkpoint."""

    def stats(self) -> dict:
        """Counters of the service (queue depth, groups in/out/dropped, staleness, credit waits)."""


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
            status = self.buffer.push(Entry.of(group, encode_group(group)), len(group.trajectories))
            self._cond.notify_all()
            return status

    def send(self, group: Group) -> None:
        self.push(group)

    def flush(self, timeout: float | None = None) -> None:
        pass  # every push is stored before it returns

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
            return [decode_group(e.blob) for e in shard]

    def ack(self, step: int, rank: int, wait: bool = True) -> None:
        with self._cond:
            self.buffer.ack(step, rank)
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return self.buffer.snapshot()
