"""Admission, staleness and sharding rules of the replay buffer (no sockets)."""

import pytest

from replay.buffer import ReplayBuffer

from tests.replay.helpers import make_entry


def test_capacity_follows_the_areal_formula():
    buf = ReplayBuffer(groups_per_step=2, max_staleness=1, num_shards=1)
    # v = 0: capacity = (η + v + 1)·B − (accepted + in_flight) = (1 + 0 + 1)·2 − 0 = 4
    credits = [buf.grant("a") for _ in range(5)]
    assert [c is not None for c in credits] == [True] * 4 + [False]
    for i in range(4):
        buf.push(make_entry(version=0, seed=i, actor="a"))
    assert buf.capacity == 0  # (2)·2 − (4 + 0)
    assert len(buf.take(step=0, rank=0)) == 2
    buf.set_version(1)
    assert buf.capacity == 2  # (1 + 1 + 1)·2 − (4 + 0)


def test_stale_groups_are_dropped_counted_and_make_room():
    buf = ReplayBuffer(groups_per_step=1, max_staleness=1)
    buf.push(make_entry(version=0, seed=1))
    buf.push(make_entry(version=2, seed=2))
    buf.set_version(2)  # the v0 group is 2 > η = 1 versions old
    batch = buf.take(step=2, rank=0)
    assert [g.version for g in batch] == [2]
    assert buf.stats.dropped["stale"] == 1 and buf.accepted == 1
    assert buf.stats.staleness_served[0] == 1


def test_two_ranks_get_disjoint_shards_of_one_batch():
    buf = ReplayBuffer(groups_per_step=4, max_staleness=0, num_shards=2)
    groups = [make_entry(seed=i) for i in range(4)]
    for g in groups:
        buf.push(g)
    a, b = buf.take(0, 1), buf.take(0, 0)
    assert len(a) == len(b) == 2
    assert {g.group_id for g in a}.isdisjoint({g.group_id for g in b})
    assert {g.group_id for g in a + b} == {g.group_id for g in groups}
    with pytest.raises(ValueError, match="rank"):
        buf.take(0, 2)


def test_duplicates_are_stored_once():
    buf = ReplayBuffer(groups_per_step=1, max_staleness=0)
    g = make_entry()
    assert buf.push(g) == "stored" and buf.push(g) == "duplicate"
    assert len(buf.queue) == 1 and buf.stats.duplicates == 1


def test_restarted_actor_releases_its_credits():
    buf = ReplayBuffer(groups_per_step=2, max_staleness=0)
    assert buf.grant("a") and buf.grant("a") and buf.grant("a") is None
    buf.hello("a")
    assert buf.grant("a") is not None


def test_shards_must_divide_the_batch():
    with pytest.raises(ValueError, match="divide"):
        ReplayBuffer(groups_per_step=3, max_staleness=0, num_shards=2)


def test_deduplication_memory_is_bounded():
    buf = ReplayBuffer(groups_per_step=2, max_staleness=1000, dedupe_window=3)
    entries = [make_entry(seed=i) for i in range(5)]
    for e in entries:
        assert buf.push(e) == "stored"
    assert len(buf.seen) == 3
    assert buf.push(entries[4]) == "duplicate"  # a recent resend is still caught


def test_credits_of_an_actor_silent_past_the_lease_go_back():
    now = [0.0]
    buf = ReplayBuffer(groups_per_step=2, max_staleness=0, lease_s=60.0, clock=lambda: now[0])
    assert buf.grant("gone") and buf.grant("gone") and buf.grant("busy") is None  # capacity (0+0+1)·2 = 2
    now[0] = 50.0
    assert buf.expire() == 0  # within the lease
    now[0] = 61.0
    assert buf.expire() == 2 and buf.stats.credits_expired == 2  # "gone" never came back
    assert buf.grant("busy") is not None
    now[0] = 100.0
    buf.push(make_entry(version=0, seed=1, actor="busy"))  # a push renews the lease
    assert buf.grant("busy") is not None
    now[0] = 150.0
    assert buf.expire() == 0  # heard from 50 s ago
    assert buf.snapshot()["credits_expired"] == 2


def test_groups_of_equal_rewards_are_dropped_until_too_many_come_in_a_row():
    buf = ReplayBuffer(groups_per_step=2, max_staleness=8, drop_zero_variance=True, drop_patience=2)
    signal = lambda seed: make_entry(seed=seed, rewards=[0.0, 1.0, 0.0, 1.0])  # noqa: E731
    equal = lambda seed, r=0.0: make_entry(seed=seed, rewards=[r] * 4)  # noqa: E731
    assert [buf.push(equal(i, r=float(i % 2))) for i in range(4)] == ["filtered"] * 4
    assert buf.stats.dropped["zero_variance"] == 4 and not buf.queue
    # 2 steps' worth (4 groups) dropped in a row: a task the policy never or always solves still trains
    assert [buf.push(equal(i)) for i in range(4, 7)] == ["stored"] * 3
    assert buf.stats.kept_equal == 3 and len(buf.take(0, 0)) == 2
    # a group with a signal ends the run of equal ones: they are dropped again
    assert buf.push(signal(7)) == "stored"
    assert [buf.push(equal(i)) for i in (8, 9)] == ["filtered"] * 2
    assert buf.push(signal(10)) == "stored" and buf.push(equal(11)) == "filtered"
    assert buf.stats.dropped["zero_variance"] == 7 and buf.stats.kept_equal == 3
    assert buf.stats.received_groups == 5


def test_without_the_filter_equal_groups_are_stored():
    buf = ReplayBuffer(groups_per_step=1, max_staleness=0)
    assert buf.push(make_entry(rewards=[1.0] * 4)) == "stored"
    with pytest.raises(ValueError, match="--replay.drop-patience"):
        ReplayBuffer(groups_per_step=1, max_staleness=0, drop_zero_variance=True, drop_patience=0)
