"""The replay state machine: admission credits, storage, staleness, shards.

Pure bookkeeping, no sockets: `replay/server.py` puts it behind ZeroMQ and
`LocalReplay` (replay/client.py) drives it in-process for tests and debugging.

Admission (AReaL): an actor needs a credit to start a group. With staleness
bound η, B groups per learner step, learner version v, `accepted` groups stored
or already served (dropped ones excluded, so a drop re-opens room), and
`in_flight` credits granted but not yet pushed:

    capacity = (η + v + 1)·B − (accepted + in_flight)

so no group can be started that would be older than η when its step comes.
Storage is also bounded (`capacity_groups`): when full, credits wait.

Sampling: the batch of step s is the first B stored groups (FIFO) whose
staleness v − version ≤ η; older ones are dropped and counted. With N learner
ranks the batch is cut into N disjoint shards of B/N groups; the batch for a
step is assembled once, whichever rank asks first, so no group reaches two
ranks.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from replay.wire import Group


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
    served_groups: int = 0
    duplicates: int = 0
    dropped: Counter = field(default_factory=Counter)
    staleness_served: Counter = field(default_factory=Counter)
    credits_granted: int = 0
    malformed_frames: int = 0

    def to_dict(self) -> dict:
        return {"received_groups": self.received_groups, "received_trajectories": self.received_trajectories,
                "received_bytes": self.received_bytes, "served_groups": self.served_groups,
                "duplicates": self.duplicates, "dropped": dict(self.dropped),
                "staleness_served": {str(k): v for k, v in self.staleness_served.items()},
                "credits_granted": self.credits_granted, "malformed_frames": self.malformed_frames}


class ReplayBuffer:
    def __init__(self, groups_per_step: int, max_staleness: int, num_shards: int = 1,
                 capacity_groups: int = 4096) -> None:
        if groups_per_step < 1 or max_staleness < 0 or num_shards < 1:
            raise ValueError("groups_per_step ≥ 1, max_staleness ≥ 0 and num_shards ≥ 1 are required")
        if groups_per_step % num_shards:
            raise ValueError(f"groups per step ({groups_per_step}) must divide evenly among "
                             f"{num_shards} learner ranks")
        self.B, self.eta, self.shards, self.capacity_groups = groups_per_step, max_staleness, num_shards, capacity_groups
        self.version = 0
        self.accepted = 0
        self.in_flight: Counter = Counter()  # actor -> credits outstanding
        self.queue: deque[Group] = deque()
        self.seen: set[str] = set()
        self.batches: dict[int, list[list[Group] | None]] = {}  # step -> shard per rank (None once taken)
        self.stats = ReplayStats()

    # -- actors -------------------------------------------------------------
    def hello(self, actor: str) -> None:
        """An actor (re)started: credits it held were lost with it."""
        self.in_flight.pop(actor, None)

    @property
    def capacity(self) -> int:
        flying = sum(self.in_flight.values())
        by_staleness = (self.eta + self.version + 1) * self.B - (self.accepted + flying)
        by_storage = self.capacity_groups - (len(self.queue) + flying)
        return min(by_staleness, by_storage)

    def grant(self, actor: str) -> Credit | None:
        """A credit for `actor` if capacity allows, else None (the caller waits)."""
        if self.capacity <= 0:
            return None
        self.in_flight[actor] += 1
        self.stats.credits_granted += 1
        return Credit(actor, self.version)

    def push(self, group: Group, nbytes: int = 0) -> str:
        """Store a group; returns "stored" or "duplicate" (already seen: stored once)."""
        if self.in_flight[group.actor] > 0:
            self.in_flight[group.actor] -= 1
        if group.group_id in self.seen:
            self.stats.duplicates += 1
            return "duplicate"
        self.seen.add(group.group_id)
        self.queue.append(group)
        self.accepted += 1
        self.stats.received_groups += 1
        self.stats.received_trajectories += len(group.trajectories)
        self.stats.received_bytes += nbytes
        return "stored"

    # -- learners -----------------------------------------------------------
    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def take(self, step: int, rank: int) -> list[Group] | None:
        """Rank `rank`'s shard of step `step`'s batch, or None while too few fresh groups are stored."""
        if not 0 <= rank < self.shards:
            raise ValueError(f"rank {rank} out of range for {self.shards} learner ranks")
        if step not in self.batches:
            batch = self._assemble()
            if batch is None:
                return None
            k = self.B // self.shards
            self.batches[step] = [batch[i * k:(i + 1) * k] for i in range(self.shards)]
        shards = self.batches[step]
        shard = shards[rank]
        if shard is None:
            raise ValueError(f"rank {rank} already took its shard of step {step}")
        shards[rank] = None
        if all(s is None for s in shards):
            del self.batches[step]
        return shard

    def _assemble(self) -> list[Group] | None:
        fresh: deque[Group] = deque()
        for g in self.queue:
            if self.version - g.version > self.eta:
                self.accepted -= 1  # a drop re-opens room for a fresh group
                self.stats.dropped["stale"] += 1
            else:
                fresh.append(g)
        self.queue = fresh
        if len(fresh) < self.B:
            return None
        batch = [fresh.popleft() for _ in range(self.B)]
        for g in batch:
            self.stats.staleness_served[self.version - g.version] += 1
        self.stats.served_groups += len(batch)
        return batch

    def snapshot(self) -> dict:
        return {"version": self.version, "queue_groups": len(self.queue), "accepted": self.accepted,
                "in_flight": sum(self.in_flight.values()), "capacity": self.capacity, **self.stats.to_dict()}
