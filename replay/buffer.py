"""The replay state machine: admission credits, storage, staleness, shards.

Pure bookkeeping, no sockets: `replay/server.py` puts it behind ZeroMQ and
`LocalReplay` (replay/client.py) drives it in-process for tests and debugging.
Groups are held as the validated blobs they arrived as (`Entry.blob`: a ZeroMQ
frame, or a view of an actor's shared-memory arena), so serving them costs no
re-encoding.

Admission (AReaL): an actor needs a credit to start a group. With staleness
bound η, B groups per learner step, learner version v, `accepted` groups stored
or already served (dropped ones excluded, so a drop re-opens room), and
`in_flight` credits granted but not yet pushed:

    capacity = (η + v + 1)·B − (accepted + in_flight)

so no group can be started that would be older than η when its step comes.
Storage is also bounded, in groups and in bytes: when full, credits wait.
Nothing is ever dropped for lack of room.

Sampling: the batch of step s is B stored groups whose staleness v − version
≤ η, oldest first (FIFO) or newest first; older ones are dropped and counted.
With N learner ranks the batch is cut into N disjoint shards of B/N groups; the
batch is assembled once, whichever rank asks first, so no group reaches two
ranks. A shard stays assigned until its rank acknowledges it (after the
optimizer step); asking again for the same step returns the same shard, so a
learner that restarts mid-step loses nothing and double-counts nothing. A rank
that asks for a later step while it still holds an unacknowledged shard (it
restarted from a checkpoint taken before that step's update) will never
acknowledge it: the shard is released, its groups go back to the front of the
queue in their order, and are served again under the usual staleness rule.

With a log (replay/log.py) all of this survives a SIGKILL of the replay
process: the assignment of a batch is on the log before any shard of it is
served, and so are acknowledgements and releases before they are answered. A
new replay on the same log holds every shard still assigned, with its rank
(the same rank asking for the same step gets the same shard, another rank its
own; `ack` consumes it) and queues every other unconsumed group: no group is
trained twice and none is lost. What replay cannot know is an acknowledgement
that never reached it: a rank must acknowledge a step (`LearnerReplay.ack`)
before any checkpoint it resumes from says the step was trained.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from replay.wire import Group


@dataclass
class Entry:
    """A stored group: what sampling needs, plus the bytes to serve."""

    group_id: str
    version: int
    rewards: np.ndarray
    spread: float
    """max − min of what the group's episodes achieved (`Group.outcome_spread`): dynamic sampling
    drops a group where it is 0."""
    blob: Any  # bytes, the ZeroMQ frame it arrived in, or a view of an actor's arena (served again without a copy)
    actor: str = ""
    ref: list | None = None
    """[arena, offset, length] when the blob lives in an actor's shared-memory arena (replay/arena.py)."""
    release: Callable[[], None] | None = None
    """Called once when replay is done with the group (consumed, dropped, or never stored)."""

    @classmethod
    def of(cls, group: Group, blob: Any, ref: list | None = None, release: Callable[[], None] | None = None) -> Entry:
        return cls(group.group_id, group.version, group.rewards, group.outcome_spread, blob, group.actor, ref, release)

    def free(self) -> None:
        if self.release is not None:
            release, self.release = self.release, None
            release()


@dataclass
class Credit:
    actor: str
    version: int
    """The learner version when granted: the actor generates with at least this adapter."""


@dataclass
class ReplayStats:
    received_groups: int = 0
    received_trajectories: int = 0
    received_bytes: int = 0
    received_shared: int = 0
    """Groups that came through an actor's shared-memory arena rather than the socket."""
    served_groups: int = 0
    served_bytes: int = 0
    released_groups: int = 0
    """Groups of shards that their rank moved past unacknowledged: back in the queue."""
    duplicates: int = 0
    dropped: Counter = field(default_factory=Counter)
    staleness_served: Counter = field(default_factory=Counter)
    kept_equal: int = 0
    """Groups of equal rewards kept although the filter is on: they came after `drop_limit` in a row."""
    credits_granted: int = 0
    credits_expired: int = 0
    """Credits taken back from actors silent for longer than the lease (`ReplayBuffer.expire`)."""
    malformed_frames: int = 0

    def to_dict(self) -> dict:
        return {"received_groups": self.received_groups, "received_trajectories": self.received_trajectories,
                "received_bytes": self.received_bytes, "received_shared": self.received_shared,
                "served_groups": self.served_groups,
                "served_bytes": self.served_bytes, "released_groups": self.released_groups,
                "duplicates": self.duplicates, "dropped": dict(self.dropped), "kept_equal": self.kept_equal,
                "staleness_served": {str(k): v for k, v in sorted(self.staleness_served.items())},
                "credits_granted": self.credits_granted, "credits_expired": self.credits_expired,
                "malformed_frames": self.malformed_frames}


class RecentIds:
    """The last `limit` group ids seen, in arrival order: enough to deduplicate resends (which
    come within a client timeout of the original) at a bounded memory cost in week-long runs."""

    def __init__(self, limit: int, ids=()) -> None:
        self.limit = limit
        self._ids: dict[str, None] = {}
        for gid in ids:
            self.add(gid)

    def __contains__(self, gid: str) -> bool:
        return gid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, gid: str) -> None:
        self._ids[gid] = None
        if len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]


class ReplayBuffer:
    def __init__(self, groups_per_step: int, max_staleness: int, num_shards: int = 1,
                 capacity_groups: int = 4096, capacity_bytes: int = 4 << 30, order: str = "fifo",
                 drop_zero_variance: bool = False, log=None, dedupe_window: int = 250_000,
                 lease_s: float = 600.0, clock=None, drop_patience: int = 2) -> None:
        if groups_per_step < 1 or max_staleness < 0 or num_shards < 1:
            raise ValueError("groups_per_step ≥ 1, max_staleness ≥ 0 and num_shards ≥ 1 are required")
        if groups_per_step % num_shards:
            raise ValueError(f"groups per step ({groups_per_step}) must divide evenly among "
                             f"{num_shards} learner ranks")
        if order not in ("fifo", "newest"):
            raise ValueError(f"--replay.order must be 'fifo' or 'newest', got {order!r}")
        self.B, self.eta, self.shards = groups_per_step, max_staleness, num_shards
        self.capacity_groups, self.capacity_bytes, self.order = capacity_groups, capacity_bytes, order
        if drop_patience < 1:
            raise ValueError(f"--replay.drop-patience must be at least 1, got {drop_patience}")
        self.drop_zero_variance = drop_zero_variance
        self.drop_limit = drop_patience * groups_per_step
        """Equal-reward groups dropped in a row before such groups are kept again (`admit`)."""
        self.dropped_in_a_row = 0
        self.log = log
        self.version = 0
        self.accepted = 0
        self.pending = 0  # admitted, not yet committed (being written to the log)
        self.stored_bytes = 0
        self.in_flight: Counter = Counter()  # actor -> credits outstanding
        self.lease_s = lease_s
        """Credits of an actor not heard from (no credit request, no push) for this long go back."""
        self._clock = clock or time.monotonic
        self._heard: dict[str, float] = {}  # actor -> when it last asked for a credit or pushed
        self.queue: deque[Entry] = deque()
        self.seen = RecentIds(dedupe_window)
        self.batches: dict[int, list[list[Entry] | None]] = {}  # step -> shard per rank (None once acked)
        self.stats = ReplayStats()
        if log is not None:
            self._recover()

    def _recover(self) -> None:
        """Load what the log holds: the unconsumed groups, in order, and the shards still
        assigned, each with its rank again (out of the queue). A batch cut for another number
        of ranks cannot be given back as it was: its groups stay queued and it is released."""
        from replay.wire import decode_group

        found = self.log.restore()
        self.seen = RecentIds(self.seen.limit, found.seen)
        entries = {gid: Entry.of(decode_group(blob), blob) for gid, blob in found.groups}
        self.stored_bytes = sum(len(e.blob) for e in entries.values())
        self.accepted = len(entries)
        for step, shards in found.batches.items():
            if len(shards) != self.shards:
                for rank, ids in enumerate(shards):
                    if ids is not None:
                        self.log.released(step, rank)
                continue
            self.batches[step] = [[entries.pop(gid) for gid in ids] if ids is not None else None
                                  for ids in shards]
        self.queue.extend(entries.values())

    # -- actors -------------------------------------------------------------
    def hello(self, actor: str) -> None:
        """An actor (re)started: credits it held were lost with it."""
        self.in_flight.pop(actor, None)
        self._heard[actor] = self._clock()

    def expire(self) -> int:
        """Take back the credits of actors silent for longer than the lease: an actor that died
        and never said hello again (its node lost for good, a run resumed with fewer --actors)
        would otherwise hold them, and admission would shrink for the rest of the run. A live
        actor that was only slow pushes its group as usual (it is stored; the staleness bound
        still holds at sampling). Returns the credits taken back."""
        now, taken = self._clock(), 0
        for actor in [a for a, n in self.in_flight.items() if n > 0]:
            if now - self._heard.get(actor, now) > self.lease_s:
                taken += self.in_flight.pop(actor)
        self.stats.credits_expired += taken
        return taken

    @property
    def capacity(self) -> int:
        flying = sum(self.in_flight.values()) + self.pending
        by_staleness = (self.eta + self.version + 1) * self.B - (self.accepted + flying)
        by_storage = self.capacity_groups - (len(self.queue) + flying)
        return min(by_staleness, by_storage) if self.stored_bytes < self.capacity_bytes else 0

    def grant(self, actor: str) -> Credit | None:
        """A credit for `actor` if capacity allows, else None (the caller waits)."""
        self._heard[actor] = self._clock()
        if self.capacity <= 0:
            return None
        self.in_flight[actor] += 1
        self.stats.credits_granted += 1
        return Credit(actor, self.version)

    def push(self, entry: Entry, trajectories: int = 0) -> str:
        """Store a group: "stored", "duplicate" (seen before: stored once) or "filtered"
        (zero reward variance with the dynamic-sampling filter on)."""
        status = self.admit(entry)
        if status is not None:
            return status
        if self.log is not None:
            self.log.stored(entry.group_id, entry.blob)
        self.commit(entry, trajectories)
        return "stored"

    def admit(self, entry: Entry) -> str | None:
        """The first half of `push`: "duplicate" or "filtered", or None when the group is to be
        stored; it is then pending (counted against capacity) until `commit`. A server with a
        log writer commits once the group is on the log."""
        self._heard[entry.actor] = self._clock()
        if self.in_flight[entry.actor] > 0:
            self.in_flight[entry.actor] -= 1
        if entry.group_id in self.seen:
            self.stats.duplicates += 1
            entry.free()
            return "duplicate"
        self.seen.add(entry.group_id)
        if self.drop_zero_variance and self._drops(entry):
            self.stats.dropped["zero_variance"] += 1
            entry.free()
            return "filtered"
        self.pending += 1
        return None

    def _drops(self, entry: Entry) -> bool:
        """Dynamic sampling: whether to drop `entry`, a group whose episodes all achieved the same
        (it carries no group-relative signal about the task; under a turn discount their returns
        may still differ by length, which only ranks the episodes of groups kept). Never starves
        the learner: once `drop_limit` such groups came in a row (a task the policy always or never
        solves), they are kept, as without the filter, until a group with a signal comes."""
        if entry.spread != 0:
            self.dropped_in_a_row = 0
            return False
        if self.dropped_in_a_row >= self.drop_limit:
            self.stats.kept_equal += 1
            return False
        self.dropped_in_a_row += 1
        return True

    def commit(self, entry: Entry, trajectories: int = 0) -> None:
        """The second half of `push`: the group is stored and may be sampled."""
        self.pending -= 1
        self.queue.append(entry)
        self.accepted += 1
        self.stored_bytes += len(entry.blob)
        self.stats.received_groups += 1
        self.stats.received_trajectories += trajectories
        self.stats.received_bytes += len(entry.blob)
        self.stats.received_shared += entry.ref is not None

    # -- learners -----------------------------------------------------------
    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def take(self, step: int, rank: int) -> list[Entry] | None:
        """Rank `rank`'s shard of step `step`'s batch (the same one until acknowledged),
        or None while too few fresh groups are stored. A shard the rank still holds of an
        earlier step is released first: the rank has moved past it without training on it."""
        if not 0 <= rank < self.shards:
            raise ValueError(f"rank {rank} out of range for {self.shards} learner ranks")
        for earlier in [s for s, shards in self.batches.items() if s < step and shards[rank] is not None]:
            self.release(earlier, rank)
        if step not in self.batches:
            batch = self._assemble()
            if batch is None:
                return None
            k = self.B // self.shards
            self.batches[step] = [batch[i * k:(i + 1) * k] for i in range(self.shards)]
            if self.log is not None:  # before any shard of it is served
                self.log.assigned(step, [[e.group_id for e in shard] for shard in self.batches[step]])
        shard = self.batches[step][rank]
        if shard is None:
            raise ValueError(f"rank {rank} already acknowledged (or moved past) its shard of step {step}")
        return shard

    def ack(self, step: int, rank: int) -> list[str]:
        """The rank trained on its shard of `step`: it is consumed for good. Returns its group ids
        ([] for a shard replay does not hold: acknowledged already, or released)."""
        shard = self._unassign(step, rank)
        if shard is None:
            return []
        ids = [e.group_id for e in shard]
        for e in shard:
            self.stored_bytes -= len(e.blob)
            e.free()
        if self.log is not None:
            self.log.consumed(ids, shard=(step, rank))
        return ids

    def release(self, step: int, rank: int) -> list[str]:
        """Rank `rank` will never train on its shard of `step` (it asked for a later step): the
        groups go back to the front of the queue, in their order. Returns their ids."""
        shard = self._unassign(step, rank)
        if shard is None:
            return []
        self.queue.extendleft(reversed(shard))
        self.stats.released_groups += len(shard)
        if self.log is not None:
            self.log.released(step, rank)
        return [e.group_id for e in shard]

    def _unassign(self, step: int, rank: int) -> list[Entry] | None:
        """Take rank `rank`'s shard of `step` out of the assignments (None if it holds none)."""
        shards = self.batches.get(step)
        if shards is None or not 0 <= rank < self.shards or shards[rank] is None:
            return None
        shard, shards[rank] = shards[rank], None
        if all(s is None for s in shards):
            del self.batches[step]
        return shard

    def _assemble(self) -> list[Entry] | None:
        fresh: deque[Entry] = deque()
        for e in self.queue:
            if self.version - e.version > self.eta:
                self.accepted -= 1  # a drop re-opens room for a fresh group
                self.stored_bytes -= len(e.blob)
                self.stats.dropped["stale"] += 1
                if self.log is not None:
                    self.log.consumed([e.group_id])
                e.free()
            else:
                fresh.append(e)
        self.queue = fresh
        if len(fresh) < self.B:
            return None
        pop = fresh.popleft if self.order == "fifo" else fresh.pop
        batch = [pop() for _ in range(self.B)]
        for e in batch:
            self.stats.staleness_served[self.version - e.version] += 1
            self.stats.served_bytes += len(e.blob)
        self.stats.served_groups += len(batch)
        return batch

    def snapshot(self) -> dict:
        return {"version": self.version, "queue_groups": len(self.queue), "stored_bytes": self.stored_bytes,
                "accepted": self.accepted, "in_flight": sum(self.in_flight.values()), "pending": self.pending,
                "capacity": self.capacity,
                "shards_unacked": sum(s is not None for v in self.batches.values() for s in v),
                **self.stats.to_dict()}
