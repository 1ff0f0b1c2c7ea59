"""The replay service over real ZeroMQ sockets."""

import re
import threading

import numpy as np
import pytest
import zmq

from replay.buffer import ReplayBuffer
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.server import ReplayServer
from replay.wire import OUTCOME_SPREAD, WireError

from tests.replay.helpers import assert_same_images, bad_image_blobs, make_group, make_image_group


@pytest.fixture
def server():
    srv = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=1, num_shards=2), "tcp://127.0.0.1:*")
    srv.start()
    yield srv
    srv.stop()


def test_listens_on_loopback_by_default(server):
    assert server.endpoint.startswith("tcp://127.0.0.1:")


def test_round_trip_credits_push_and_sharded_sample(server):
    actor = ZmqActorReplay(server.endpoint, actor="actor-0")
    actor.hello()
    for _ in range(4):
        actor.request_credit()
    got = []
    while len(got) < 4:
        got += actor.credits(timeout=5)
    assert got == [0, 0, 0, 0]
    groups = [make_group(seed=i) for i in range(4)]
    assert [actor.push(g) for g in groups] == ["stored"] * 4

    shards = {}

    def learn(rank):
        shards[rank] = ZmqLearnerReplay(server.endpoint).sample(step=0, rank=rank, version=0, timeout=10)

    threads = [threading.Thread(target=learn, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    ids = [[g.group_id for g in shards[r]] for r in (0, 1)]
    assert len(ids[0]) == len(ids[1]) == 2 and set(ids[0]).isdisjoint(ids[1])
    assert set(ids[0] + ids[1]) == {g.group_id for g in groups}
    sent = {g.group_id: g for g in groups}
    for g in shards[0] + shards[1]:
        np.testing.assert_array_equal(g.trajectories[0].tokens, sent[g.group_id].trajectories[0].tokens)


@pytest.mark.parametrize("rewards, spread, status", [
    ([1.0] * 4, None, "filtered"),
    ([0.0, 1.0, 0.0, 1.0], None, "stored"),
    # played under --actor.turn-discount 0.9: returns differ with the episodes' lengths
    ([0.9, 0.81, 0.729, 0.9], 0.0, "filtered"),    # every episode solved the task
    ([0.9, 0.0, 0.729, 0.0], 1.0, "stored"),       # some failed
])
def test_a_group_whose_episodes_all_achieved_the_same_is_acknowledged_as_filtered(rewards, spread, status):
    """Over a real socket the replay drops a group whose episodes all achieved the same (their
    rewards, or under a turn discount the undiscounted ones the actor sends beside them)."""
    srv = ReplayServer(ReplayBuffer(groups_per_step=1, max_staleness=1, drop_zero_variance=True),
                       "tcp://127.0.0.1:*")
    srv.start()
    try:
        actor = ZmqActorReplay(srv.endpoint, actor="a")
        actor.hello()
        group = make_group(seed=1, rewards=rewards)
        if spread is not None:
            group.meta[OUTCOME_SPREAD] = spread
        assert actor.push(group) == status
        stats = srv.snapshot()
        assert stats["dropped"] == ({"zero_variance": 1} if status == "filtered" else {})
        assert stats["received_groups"] == (status == "stored")
    finally:
        srv.stop()


def test_credits_wait_until_the_learner_advances(server):
    actor = ZmqActorReplay(server.endpoint, actor="a")
    for _ in range(9):
        actor.request_credit()
    got = []
    for _ in range(20):
        got += actor.credits(timeout=0.2)
    assert len(got) == 8  # (η + v + 1)·B = (1 + 0 + 1)·4
    for i in range(8):
        actor.push(make_group(seed=i, actor="a"))
    learner = ZmqLearnerReplay(server.endpoint)
    learner.sample(step=0, rank=0, version=0, timeout=5)
    learner.sample(step=0, rank=1, version=0, timeout=5)
    learner.sample(step=1, rank=0, version=1, timeout=5)  # version 1 opens B more credits
    assert actor.credits(timeout=5) == [1]


def test_duplicate_push_is_stored_once(server):
    actor = ZmqActorReplay(server.endpoint, actor="a")
    g = make_group()
    assert actor.push(g) == "stored"
    assert actor.push(g) == "duplicate"
    stats = actor.stats()
    assert stats["queue_groups"] == 1 and stats["duplicates"] == 1


def test_pipelined_sends_are_acknowledged_and_deduplicated(server):
    actor = ZmqActorReplay(server.endpoint, actor="a", window=3)
    groups = [make_group(seed=i) for i in range(7)]
    for g in groups + groups[:2]:
        actor.send(g)
    actor.flush(timeout=10)
    assert actor.statuses == {"stored": 7, "duplicate": 2}
    assert actor.stats()["queue_groups"] == 7
    bad = make_group(seed=9)
    bad.trajectories[0].logprobs[3] = float("nan")  # refused by the server, counted, not resent
    actor.send(bad)
    actor.send(make_group(seed=10))
    actor.flush(timeout=10)
    assert actor.statuses == {"stored": 8, "duplicate": 2, "refused": 1}


def test_malformed_frames_get_errors_and_the_server_keeps_serving(server):
    from replay.wire import encode_group, pack_parts, unpack_parts

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    rng = np.random.default_rng(0)
    bad = [[b""], [b"\x93\x01\x02"], [rng.bytes(200)], pack_parts("push", id=1),
           pack_parts("push", [b"not a group"], id=2), pack_parts("sample", id=3, step=-1, rank=0, version=0),
           pack_parts("nonsense", id=4), [pack_parts("push", id=5)[0], encode_group(make_group())],
           [b"two", b"frames"]]
    for parts in bad:
        sock.send_multipart(parts)
        assert sock.poll(5000)
        assert unpack_parts(sock.recv_multipart())[0]["type"] == "error"
    sock.close(0)
    client = ZmqActorReplay(server.endpoint, actor="a")
    assert client.push(make_group()) == "stored"
    assert client.stats()["malformed_frames"] == len(bad)
    with pytest.raises(WireError, match="rank"):
        ZmqLearnerReplay(server.endpoint).sample(step=0, rank=5, version=0, timeout=5)


def test_groups_with_images_reach_the_learner_byte_identical(server):
    from replay.wire import encode_group

    actor = ZmqActorReplay(server.endpoint, actor="a", arena_bytes=0)  # on the socket
    groups = [make_image_group(seed=i, actor="a") for i in range(4)]
    assert [actor.push(g) for g in groups] == ["stored"] * 4
    learner = ZmqLearnerReplay(server.endpoint, arena_bytes=0)
    served = learner.sample(0, 0, 0, timeout=10) + learner.sample(0, 1, 0, timeout=10)
    sent = {g.group_id: g for g in groups}
    assert sorted(g.group_id for g in served) == sorted(sent)
    for g in served:
        assert_same_images(sent[g.group_id], g)
        assert bytes(encode_group(g)) == bytes(encode_group(sent[g.group_id]))


def test_malformed_image_groups_are_refused_and_the_server_keeps_serving(server):
    from replay.wire import pack_parts, unpack_parts

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    bad = bad_image_blobs()
    for i, (blob, message) in enumerate(bad):
        sock.send_multipart(pack_parts("push", [blob], id=i))
        assert sock.poll(5000)
        reply = unpack_parts(sock.recv_multipart())[0]
        assert reply["type"] == "error" and reply["id"] == i and re.search(message, reply["reason"]), reply
    sock.close(0)
    actor = ZmqActorReplay(server.endpoint, actor="a", arena_bytes=0)
    groups = [make_image_group(seed=i, actor="a") for i in range(4)]
    assert [actor.push(g) for g in groups] == ["stored"] * 4
    assert actor.stats()["malformed_frames"] == len(bad)
    learner = ZmqLearnerReplay(server.endpoint, arena_bytes=0)
    served = {g.group_id: g for g in learner.sample(0, 0, 0, timeout=10) + learner.sample(0, 1, 0, timeout=10)}
    for g in groups:
        assert_same_images(g, served[g.group_id])


def test_credits_asked_for_together_come_in_one_request_and_bad_counts_are_refused(server):
    from replay.wire import pack_parts, unpack_parts

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    sock.send_multipart(pack_parts("credit", id=1, actor="b", n=3))
    assert sock.poll(5000)
    reply = unpack_parts(sock.recv_multipart())[0]
    assert reply["type"] == "credit" and reply["versions"] == [0, 0, 0]
    for n in (0, -1, 5000, "3", True):
        sock.send_multipart(pack_parts("credit", id=2, actor="b", n=n))
        assert sock.poll(5000)
        assert unpack_parts(sock.recv_multipart())[0]["type"] == "error"
    sock.close(0)


def test_a_learner_that_acks_without_waiting_goes_on_and_nothing_is_served_twice(server):
    actor = ZmqActorReplay(server.endpoint, actor="a")
    groups = [make_group(seed=i, actor="a") for i in range(8)]
    for g in groups:
        actor.send(g)
    actor.flush(10)
    learner = ZmqLearnerReplay(server.endpoint)
    served = []
    for step in range(2):
        for rank in (0, 1):
            served += [g.group_id for g in learner.sample(step=step, rank=rank, version=step, timeout=5)]
            learner.ack(step, rank, wait=False)
    assert sorted(served) == sorted(g.group_id for g in groups)
    stats = learner.stats()  # answered after the acks, which came first on the same socket
    assert stats["shards_unacked"] == 0 and stats["served_groups"] == 8 and not learner._acks
