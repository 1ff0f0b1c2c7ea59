"""Batch assignments on the replay log: shards survive a replay restart with their ranks,
a shard a rank moved past goes back to the queue, acks survive a restart too."""

import time

import pytest

from replay.buffer import ReplayBuffer
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.log import BLOCK, ReplayLog, history
from tests.replay.helpers import KEY, ReplayProcess, make_entry, make_group


def on_log(path, groups_per_step: int = 4, ranks: int = 2, max_staleness: int = 1000,
           prune: bool = True, segment_bytes: int = 256 << 20) -> ReplayBuffer:
    """A buffer on the log in `path`, recovering what it holds."""
    log = ReplayLog(path, fsync="always", prune=prune, segment_bytes=segment_bytes)
    return ReplayBuffer(groups_per_step, max_staleness, ranks, log=log)


def ids(shard) -> list[str]:
    return [e.group_id for e in shard]


def filled(path, n: int, **kwargs) -> tuple[ReplayBuffer, list[str]]:
    buf = on_log(path, **kwargs)
    entries = [make_entry(seed=i) for i in range(n)]
    for e in entries:
        assert buf.push(e) == "stored"
    return buf, ids(entries)


def test_assigned_shards_come_back_with_their_ranks_and_are_served_once(tmp_path):
    buf, stored = filled(tmp_path, 6)
    first = ids(buf.take(0, 0))  # rank 1 has not asked yet
    assert first == stored[:2]
    buf.log.close()

    again = on_log(tmp_path)
    assert ids(again.queue) == stored[4:]  # the assigned groups are out of the queue
    assert ids(again.take(0, 1)) == stored[2:4]  # rank 1 gets its own shard, not rank 0's
    assert ids(again.take(0, 0)) == first  # and rank 0 the same one again
    assert again.ack(0, 0) == first and again.ack(0, 0) == []  # twice: consumed once
    served = first + ids(again.take(0, 1))
    assert again.ack(0, 1) == stored[2:4]
    for e in [make_entry(seed=10 + i) for i in range(2)]:
        again.push(e)
    served += ids(again.take(1, 0)) + ids(again.take(1, 1))
    assert len(served) == len(set(served)) == 8 and set(stored) <= set(served)
    again.log.close()


def test_a_shard_consumed_is_not_restored_and_one_still_held_is(tmp_path):
    buf, stored = filled(tmp_path, 4)
    buf.take(0, 0)
    assert buf.ack(0, 0) == stored[:2]
    buf.log.close()

    again = on_log(tmp_path, prune=False)  # the audit below reads the whole log
    assert [None if s is None else ids(s) for s in again.batches[0]] == [None, stored[2:]]
    assert not again.queue and again.snapshot()["shards_unacked"] == 1
    with pytest.raises(ValueError, match="already acknowledged"):
        again.take(0, 0)
    assert again.ack(0, 1) == stored[2:]
    again.log.close()

    assert not on_log(tmp_path, prune=False).batches  # both consumed: nothing to restore
    audit = history(tmp_path)
    assert audit["complete"] and audit["trained"] == {gid: [0, i // 2] for i, gid in enumerate(stored)}
    assert audit["consumed"] == set(stored) and not audit["open"] and not audit["queued"]


def test_a_rank_that_moves_past_its_shard_releases_it_to_the_front_of_the_queue(tmp_path):
    buf, stored = filled(tmp_path, 4)
    buf.take(0, 0), buf.take(0, 1)
    buf.ack(0, 0)
    late = make_entry(seed=10)
    buf.push(late)
    assert buf.take(1, 1) is None  # rank 1 resumed from a checkpoint before step 0's update
    assert ids(buf.queue) == stored[2:] + [late.group_id]  # its shard back in front, in order
    assert buf.stats.released_groups == 2 and 0 not in buf.batches
    buf.log.close()

    again = on_log(tmp_path)  # the release is on the log: the shard is not restored
    assert not again.batches and ids(again.queue) == stored[2:] + [late.group_id]
    assert history(tmp_path)["released"] == [(0, 1)]
    again.push(make_entry(seed=11))
    assert ids(again.take(1, 0)) == stored[2:]  # served again, once
    again.log.close()


def test_released_groups_obey_the_staleness_bound_when_served_again(tmp_path):
    buf, stored = filled(tmp_path, 4, groups_per_step=2, ranks=1, max_staleness=1)
    assert ids(buf.take(0, 0)) == stored[:2]
    buf.set_version(5)  # the learner resumed far ahead: every group is now too old
    assert buf.take(5, 0) is None
    assert buf.stats.dropped["stale"] == 4 and not buf.queue and not buf.batches
    buf.log.close()
    assert history(tmp_path)["dropped"] == set(stored)


def test_pruning_segments_keeps_the_assignments_still_open(tmp_path):
    buf, stored = filled(tmp_path, 4, segment_bytes=3_000)  # about a segment per group
    buf.take(0, 0)  # the assignment lands in a later segment than its groups
    buf.ack(0, 0)  # the first two groups' segments go
    assert len(buf.log.segments()) < 6
    buf.log.close()
    again = on_log(tmp_path, segment_bytes=3_000)
    assert [None if s is None else ids(s) for s in again.batches[0]] == [None, stored[2:]]
    again.ack(0, 1)
    assert len(again.log.segments()) == 1
    again.log.close()
    assert not on_log(tmp_path).batches


def test_a_torn_assignment_record_at_the_end_is_cut_off(tmp_path):
    buf, stored = filled(tmp_path, 4)
    buf.take(0, 0)
    buf.log.close()
    seg = sorted(tmp_path.glob("*.seg"))[0]  # the batch's assignment is its last record, one block
    data = bytearray(seg.read_bytes())
    data[-BLOCK + 20] ^= 0xFF  # a crash mid-write
    seg.write_bytes(bytes(data))

    audit = history(tmp_path)  # reads around the torn record and leaves it in place
    assert audit["assignments"] == [] and audit["queued"] == stored and seg.stat().st_size == len(data)
    again = on_log(tmp_path)
    assert not again.batches and ids(again.queue) == stored
    assert seg.stat().st_size == len(data) - BLOCK
    again.log.close()


def test_a_log_cut_for_another_number_of_ranks_gives_its_groups_back(tmp_path):
    buf, stored = filled(tmp_path, 4)
    buf.take(0, 0)
    buf.log.close()
    one = on_log(tmp_path, groups_per_step=4, ranks=1)
    assert not one.batches and ids(one.queue) == stored
    one.log.close()
    assert not history(tmp_path)["open"]


def served_ids(groups) -> list[str]:
    return [g.group_id for g in groups]


@pytest.mark.parametrize("ack", ["before the kill", "after the kill"])
def test_a_sigkilled_replay_gives_each_rank_its_own_shard_and_consumes_the_late_ack(tmp_path, ack):
    replay = ReplayProcess(tmp_path / "log", groups_per_step=4, learners=2)
    actor = ZmqActorReplay(replay.endpoint, actor="actor-0", key=KEY, timeout=5, arena_bytes=0)
    ranks = [ZmqLearnerReplay(replay.endpoint, key=KEY, timeout=5, check_every=1.0) for _ in range(2)]
    groups = [make_group(seed=i) for i in range(12)]
    assert [actor.push(g) for g in groups] == ["stored"] * 12
    served = served_ids(ranks[0].sample(0, 0, 0, timeout=10))  # rank 1 has not asked yet
    if ack == "before the kill":
        replay.pause()  # the ack reaches a replay that never reads it
        ranks[0].ack(0, 0, wait=False)
        time.sleep(0.3)  # out of this process's ZeroMQ queue, into the stopped replay's socket
    replay.stop()
    if ack == "after the kill":
        ranks[0].ack(0, 0, wait=False)
    (step, shards), = history(replay.log_dir)["assignments"]
    assert step == 0 and shards[0] == served

    replay.restart()
    try:
        mine = served_ids(ranks[1].sample(0, 1, 0, timeout=10))
        assert mine == shards[1]  # its own shard, not rank 0's groups
        served += mine
        ranks[1].ack(0, 1)
        for step in (1, 2):
            for rank in (0, 1):
                served += served_ids(ranks[rank].sample(step, rank, step, timeout=10))
            for rank in (0, 1):
                ranks[rank].ack(step, rank)
        assert sorted(served) == sorted(g.group_id for g in groups)  # each one exactly once
        stats = ranks[0].stats()
        assert stats["queue_groups"] == 0 and stats["shards_unacked"] == 0 and stats["released_groups"] == 0
        assert not ranks[0]._acks
    finally:
        replay.stop()
    audit = history(replay.log_dir)
    assert audit["consumed"] == set(served) and not audit["released"] and not audit["dropped"]
    assert audit["trained"] == {gid: [i // 4, i % 4 // 2] for i, gid in enumerate(served)}


def test_an_ack_a_dead_replay_never_answered_is_sent_again_to_the_new_one(tmp_path):
    replay = ReplayProcess(tmp_path / "log")
    actor = ZmqActorReplay(replay.endpoint, actor="actor-0", key=KEY, timeout=5, arena_bytes=0)
    learner = ZmqLearnerReplay(replay.endpoint, key=KEY, timeout=5, check_every=1.0)
    for i in range(4):
        actor.push(make_group(seed=i))
    trained = served_ids(learner.sample(0, 0, 0, timeout=10))
    replay.pause()
    learner.ack(0, 0, wait=False)  # sent; never read, never answered
    time.sleep(0.3)  # out of this process's ZeroMQ queue, into the stopped replay's socket
    replay.restart()
    try:
        assert learner.stats()["shards_unacked"] == 1  # restored; this reply shows the new epoch
        assert learner._acks  # ... and the ack went out again, ahead of anything else
        deadline = time.monotonic() + 10
        while learner._acks and time.monotonic() < deadline:  # answered once on the log
            time.sleep(0.05)
            learner.stats()  # reads the ack's answer
        assert not learner._acks
        stats = learner.stats()
        assert stats["shards_unacked"] == 0 and stats["queue_groups"] == 2
    finally:
        replay.stop()
    assert history(replay.log_dir)["trained"] == {gid: [0, 0] for gid in trained}
