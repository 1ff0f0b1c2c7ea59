"""The same-host path: groups through actors' shared-memory arenas, and every way back to bytes."""

import os
import subprocess
import sys

import numpy as np
import pytest
import zmq

from replay.arena import FREE, HELD, PAGE, Arena, ArenaReader, head_size, host_id, pages
from replay.buffer import ReplayBuffer
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.server import ReplayServer
from replay.wire import WireError, encode_group, pack_parts, unpack_parts
from tests.replay.helpers import assert_same_images, make_group, make_image_group

KEY = bytes(range(32))


def serve(tmp_path, arena_dir=None, **kwargs) -> ReplayServer:
    buffer = ReplayBuffer(groups_per_step=kwargs.pop("batch", 2), max_staleness=1000, **kwargs)
    srv = ReplayServer(buffer, "tcp://127.0.0.1:*", key=KEY, arena_dir=str(arena_dir or tmp_path))
    srv.start()
    return srv


def pair(srv, arenas, arena_bytes: int = 1 << 20):
    """An actor (said hello, so its arena is offered) and a learner, both on this host."""
    actor = ZmqActorReplay(srv.endpoint, actor="actor-0", key=KEY, arena_bytes=arena_bytes, arena_dir=str(arenas))
    actor.hello()
    return actor, ZmqLearnerReplay(srv.endpoint, key=KEY, arena_bytes=1 << 20, arena_dir=str(arenas))


@pytest.fixture
def arenas(tmp_path):
    """Arena files go to a test directory standing in for /dev/shm (same filesystem semantics)."""
    d = tmp_path / "shm"
    d.mkdir()
    return d


def same(a, b) -> bool:
    return a.group_id == b.group_id and all(
        np.array_equal(x.tokens, y.tokens) and np.array_equal(x.logprobs, y.logprobs)
        and np.array_equal(x.mask, y.mask) and np.array_equal(x.versions, y.versions) and x.reward == y.reward
        for x, y in zip(a.trajectories, b.trajectories))


def test_groups_go_through_the_arena_arrive_intact_and_extents_are_reused(arenas):
    srv = serve(arenas, arenas)
    try:
        actor, learner = pair(srv, arenas)
        assert actor._shared
        size = len(encode_group(make_group(length=2000)))  # ~104 KB: the 1 MiB arena holds ~10
        groups = [make_group(seed=i, length=2000) for i in range(60)]
        for step in range(30):  # six arenas' worth, consumed as it goes
            for g in groups[2 * step:2 * step + 2]:
                actor.send(g)
            actor.flush(10)
            got = learner.sample(step, 0, 0, timeout=10)
            assert all(same(a, b) for a, b in zip(sorted(got, key=lambda g: g.group_id),
                                                    sorted(groups[2 * step:2 * step + 2], key=lambda g: g.group_id)))
            learner.ack(step, 0)
        stats = learner.stats()
        assert stats["received_groups"] == stats["received_shared"] == 60 > (1 << 20) // size
        assert actor._arena.held <= 2  # everything consumed was given back
        actor.close()
        assert not list(arenas.glob("tandem-arena-*"))  # closing removes the file
    finally:
        srv.stop()


def test_groups_with_images_go_through_the_arena_and_the_learner_reads_them_in_place(arenas):
    srv = serve(arenas, arenas)
    try:
        actor, learner = pair(srv, arenas)
        assert actor._shared
        groups = [make_image_group(seed=i, actor="actor-0") for i in range(2)]
        for g in groups:
            actor.send(g)
        actor.flush(10)
        got = learner.sample(0, 0, 0, timeout=10)
        by_id = {g.group_id: g for g in groups}
        assert sorted(by_id) == sorted(g.group_id for g in got)
        for g in got:
            assert same(g, by_id[g.group_id])
            assert_same_images(by_id[g.group_id], g)
        assert learner.stats()["received_shared"] == 2
        arena = np.frombuffer(learner._reader.open(actor._arena.name), np.uint8)
        assert np.shares_memory(got[0].trajectories[0].images[0], arena)  # no copy on the way
        learner.ack(0, 0)
        assert actor._arena.held == 0
    finally:
        srv.stop()


def test_the_arena_path_holds_an_image_groups_pixels_and_sends_one_too_big_as_bytes(arenas):
    from replay.transport import ArenaPath
    from replay.wire import decode_group

    path = ArenaPath(1 << 20, str(arenas), "host")
    path.offer()
    path.accepted(True)
    try:
        g = make_image_group()
        blob = bytes(encode_group(g))
        ref = path.item(g, set)
        assert isinstance(ref, list) and ref[2] == len(blob)  # the extent is sized with the pixels
        assert bytes(path.arena.view(ref[1], ref[2])) == blob
        assert path.as_bytes(ref) == blob and path.arena.held == 0
        big = make_image_group(shapes=[[(600, 600)]])  # ~1 MiB of pixels: more than the arena holds
        item = path.item(big, set)
        assert not isinstance(item, list) and path.arena.held == 0
        assert_same_images(big, decode_group(item))
    finally:
        path.close()


def test_a_full_arena_sends_bytes_and_nothing_is_lost(arenas):
    srv = serve(arenas, arenas, batch=8)
    try:
        groups = [make_group(seed=i, length=2000) for i in range(8)]
        room = pages(len(encode_group(groups[0]))) * 2
        actor, learner = pair(srv, arenas, arena_bytes=head_size(room) + room)  # room for two groups
        for g in groups:
            actor.send(g)
        actor.flush(10)
        got = learner.sample(0, 0, 0, timeout=10)
        assert sorted(g.group_id for g in got) == sorted(g.group_id for g in groups)
        by_id = {g.group_id: g for g in groups}
        assert all(same(g, by_id[g.group_id]) for g in got)
        assert learner.stats()["received_shared"] == 2
    finally:
        srv.stop()


def test_a_replay_that_cannot_open_the_arena_gets_bytes(arenas, tmp_path):
    elsewhere = tmp_path / "other-shm"  # as for a replay in another container on the same machine
    elsewhere.mkdir()
    srv = serve(arenas, elsewhere)
    try:
        actor = ZmqActorReplay(srv.endpoint, actor="actor-0", key=KEY, arena_dir=str(arenas), arena_bytes=1 << 20)
        actor.hello()
        assert not actor._shared
        groups = [make_group(seed=i) for i in range(2)]
        assert [actor.push(g) for g in groups] == ["stored", "stored"]
        learner = ZmqLearnerReplay(srv.endpoint, key=KEY, arena_bytes=0)
        assert sorted(g.group_id for g in learner.sample(0, 0, 0, timeout=10)) == sorted(g.group_id for g in groups)
        assert learner.stats()["received_shared"] == 0
    finally:
        srv.stop()


def test_an_actor_on_another_node_of_the_same_machine_sends_bytes(arenas):
    """Two Ray nodes on one machine (network namespaces, containers) share /dev/shm, and are still
    two hosts: the launcher names each part's host by its Ray node, and replay takes an arena only
    from its own host, even one it could open."""
    buffer = ReplayBuffer(groups_per_step=2, max_staleness=1000)
    srv = ReplayServer(buffer, "tcp://127.0.0.1:*", key=KEY, arena_dir=str(arenas), host="node-a")
    srv.start()
    try:
        actor = ZmqActorReplay(srv.endpoint, actor="actor-0", key=KEY, arena_bytes=1 << 20,
                               arena_dir=str(arenas), host="node-b")
        actor.hello()
        assert not actor._shared
        groups = [make_group(seed=i) for i in range(2)]
        assert [actor.push(g) for g in groups] == ["stored", "stored"]
        learner = ZmqLearnerReplay(srv.endpoint, key=KEY, arena_bytes=1 << 20, arena_dir=str(arenas), host="node-a")
        assert sorted(g.group_id for g in learner.sample(0, 0, 0, timeout=10)) == sorted(g.group_id for g in groups)
        stats = learner.stats()
        assert stats["received_groups"] == 2 and stats["received_shared"] == 0
        same_node = ZmqActorReplay(srv.endpoint, actor="actor-1", key=KEY, arena_bytes=1 << 20,
                                   arena_dir=str(arenas), host="node-a")
        same_node.hello()
        assert same_node._shared  # the same node id: the arena is taken
    finally:
        srv.stop()


def test_a_learner_that_cannot_open_the_arena_gets_the_same_shard_as_bytes(arenas, tmp_path):
    srv = serve(arenas, arenas)
    try:
        actor = ZmqActorReplay(srv.endpoint, actor="actor-0", key=KEY, arena_bytes=1 << 20, arena_dir=str(arenas))
        actor.hello()
        groups = [make_group(seed=i) for i in range(2)]
        for g in groups:
            actor.send(g)
        actor.flush(10)
        elsewhere = tmp_path / "learner-shm"
        elsewhere.mkdir()
        learner = ZmqLearnerReplay(srv.endpoint, key=KEY, arena_bytes=1 << 20, arena_dir=str(elsewhere))
        got = learner.sample(0, 0, 0, timeout=10)
        by_id = {g.group_id: g for g in groups}
        assert sorted(by_id) == sorted(g.group_id for g in got) and all(same(g, by_id[g.group_id]) for g in got)
        assert learner.stats()["received_shared"] == 2
    finally:
        srv.stop()


def test_a_resent_reference_is_stored_once_and_freed_once_consumed(arenas):
    srv = serve(arenas, arenas)
    try:
        arena = Arena.create(1 << 20, str(arenas))
        g = make_group(seed=5, actor="a")
        where = []
        blob = encode_group(g, lambda n: (where.append(arena.alloc(n)), where[0][1])[1])
        ref = [arena.name, where[0][0], len(blob)]
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(srv.endpoint)

        def ask(msg_type, **fields):
            sock.send_multipart(pack_parts(msg_type, key=KEY, id=1, **fields))
            assert sock.poll(5000)
            return unpack_parts(sock.recv_multipart(), key=KEY)[0]

        assert ask("hello", actor="a", arena=arena.name, token=arena.token, host=host_id())["arena"] is True
        assert ask("push", shm=ref)["status"] == "stored"
        assert ask("push", shm=ref)["status"] == "duplicate"  # the resend must not free the stored copy
        assert arena.state(ref[1]) == HELD
        learner = ZmqLearnerReplay(srv.endpoint, key=KEY, arena_bytes=1 << 20, arena_dir=str(arenas))
        other = make_group(seed=6, actor="a")  # a batch is two groups: the second on the socket
        sock.send_multipart(pack_parts("push", [encode_group(other)], key=KEY, id=2))
        assert sock.poll(5000) and unpack_parts(sock.recv_multipart(), key=KEY)[0]["status"] == "stored"
        got = learner.sample(0, 0, 0, timeout=10)
        assert sorted(x.group_id for x in got) == sorted([g.group_id, other.group_id])
        assert arena.state(ref[1]) == HELD  # served, not yet trained on
        learner.ack(0, 0)
        assert arena.state(ref[1]) == FREE
        sock.close(0)
        arena.close()
    finally:
        srv.stop()


def test_hostile_references_get_errors_and_the_server_goes_on(arenas, tmp_path):
    srv = serve(arenas, arenas)
    try:
        arena = Arena.create(1 << 20, str(arenas))
        off, view = arena.alloc(1000)
        view[:] = os.urandom(1000)  # marked held, but not a group
        free_off, _ = arena.alloc(1000)
        arena.free(free_off)
        secret = tmp_path / "secret"
        secret.write_bytes(b"TARENA02" + b"x" * (4 * PAGE - 8))
        (arenas / "tandem-arena-1-0123456789abcdef").symlink_to(secret)
        (arenas / "tandem-arena-2-0123456789abcdef").write_bytes(b"not an arena".ljust(4 * PAGE))
        bad = [["../../etc/passwd", PAGE, 100], ["tandem-arena-1-0123456789abcdef", PAGE, 100],
               ["tandem-arena-2-0123456789abcdef", PAGE, 100], [arena.name, off + 64, 100], [arena.name, 0, 100],
               [arena.name, off, 0], [arena.name, off, 1 << 30], [arena.name, (1 << 20) - PAGE, 2 * PAGE],
               [arena.name, free_off, 1000], [arena.name, off, 1000], [arena.name, off], "x", [1, 2, 3],
               [arena.name, True, 5]]
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(srv.endpoint)
        for i, ref in enumerate(bad):
            sock.send_multipart(pack_parts("push", key=KEY, id=i, shm=ref))
            assert sock.poll(5000)
            reply = unpack_parts(sock.recv_multipart(), key=KEY)[0]
            assert reply["type"] == "error", ref
        assert srv.snapshot()["malformed_frames"] == len(bad)
        assert arena.state(off) == FREE  # refused content: the extent is given back
        sock.close(0)
        client = ZmqActorReplay(srv.endpoint, actor="a", key=KEY, arena_bytes=1 << 20, arena_dir=str(arenas))
        client.hello()
        groups = [make_group(seed=i, actor="a") for i in range(2)]
        assert [client.push(g) for g in groups] == ["stored", "stored"]
        assert srv.snapshot()["received_shared"] == 2
    finally:
        srv.stop()


def test_reader_refuses_names_outside_the_pattern(arenas):
    reader = ArenaReader(str(arenas))
    for name in ["", "x", "../tandem-arena-1-0123456789abcdef", "tandem-arena-1-0123456789abcdeg"]:
        with pytest.raises(WireError, match="arena"):
            reader.open(name)


def test_arenas_of_dead_processes_are_removed(arenas):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = arenas / f"tandem-arena-{proc.stdout.strip()}-0123456789abcdef"
    dead.write_bytes(b"left behind")
    live = Arena.create(1 << 20, str(arenas))
    assert not dead.exists() and live.path.exists()
    live.close()
    assert not live.path.exists()


def test_a_learner_lets_go_of_the_arena_of_an_actor_that_has_gone(arenas):
    srv = serve(arenas, arenas)
    try:
        actor, learner = pair(srv, arenas)
        for step in range(2):
            for i in range(2):
                actor.send(make_group(seed=10 * step + i))
            actor.flush(10)
            if step == 1:
                actor.close()  # the actor exits: its file goes, replay still holds its groups
            assert len(learner.sample(step, 0, 0, timeout=10)) == 2
            learner.ack(step, 0)
        assert learner._reader._maps == {}  # the gone actor's memory is not kept alive
        remote = ZmqLearnerReplay(srv.endpoint, key=KEY, arena_bytes=0)  # no reader at all
        actor2 = ZmqActorReplay(srv.endpoint, actor="actor-1", key=KEY, arena_bytes=0)
        for i in range(2):
            actor2.push(make_group(seed=100 + i))
        assert len(remote.sample(2, 0, 0, timeout=10)) == 2
    finally:
        srv.stop()


def test_the_group_path_is_chosen_by_the_arena_size_and_a_bad_size_is_refused(tmp_path):
    from replay.transport import ArenaPath, SocketPath, make_group_path

    assert isinstance(make_group_path(0, str(tmp_path), "host"), SocketPath)
    assert isinstance(make_group_path(1 << 20, str(tmp_path), None), SocketPath)
    assert isinstance(make_group_path(1 << 20, str(tmp_path), "host"), ArenaPath)
    with pytest.raises(ValueError, match="arena_bytes"):
        make_group_path(-1, str(tmp_path), "host")
