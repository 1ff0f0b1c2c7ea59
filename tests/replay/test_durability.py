"""The replay log: SIGKILL the service, start it again, count groups exactly."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.log import ReplayLog
from replay.wire import encode_group
from tests.replay.helpers import (KEY, assert_same_images, free_port, make_group, make_image_group, start_replay,
                                  with_turn_states)


@pytest.mark.parametrize("path", ["shared memory", "socket"])
def test_sigkill_and_restart_loses_nothing_and_serves_nothing_twice(tmp_path, path):
    port, log_dir = free_port(), tmp_path / "log"
    proc = start_replay(port, log_dir)
    endpoint = f"tcp://127.0.0.1:{port}"
    arena = (1 << 20) if path == "shared memory" else 0  # groups by reference, or as bytes
    actor = ZmqActorReplay(endpoint, actor="actor-0", key=KEY, timeout=5, arena_bytes=arena)
    learner = ZmqLearnerReplay(endpoint, key=KEY, timeout=5, check_every=1.0)
    groups = [make_group(seed=i) for i in range(10)]
    assert [actor.push(g) for g in groups] == ["stored"] * 10
    consumed = [g.group_id for g in learner.sample(0, 0, 0, timeout=10)]
    learner.ack(0, 0)
    in_flight = [g.group_id for g in learner.sample(1, 0, 1, timeout=10)]  # taken, never acknowledged
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    proc = start_replay(port, log_dir)
    try:
        assert actor.push(groups[3]) == "duplicate"  # the id survived the restart too
        served = []
        for step in range(1, 5):
            served += [g.group_id for g in learner.sample(step, 0, step, timeout=10)]
            learner.ack(step, 0)
        everything = {g.group_id for g in groups}
        assert len(served) == len(set(served)) == 8
        assert set(served) == everything - set(consumed)
        assert set(in_flight) <= set(served)
        assert learner.stats()["queue_groups"] == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("path", ["shared memory", "socket"])
def test_a_replay_restarted_on_its_log_serves_the_same_images_and_turn_states(tmp_path, path):
    from replay.log import groups as logged

    port, log_dir = free_port(), tmp_path / "log"
    proc = start_replay(port, log_dir)
    endpoint = f"tcp://127.0.0.1:{port}"
    actor = ZmqActorReplay(endpoint, actor="actor-0", key=KEY, timeout=5,
                           arena_bytes=(1 << 20) if path == "shared memory" else 0)
    actor.hello()
    assert actor._shared == (path == "shared memory")
    groups = [with_turn_states(make_image_group(seed=i)) for i in range(4)]
    assert [actor.push(g) for g in groups] == ["stored"] * 4
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    sent = {g.group_id: g for g in groups}
    on_log = list(logged(log_dir))  # the blobs as they arrived, images and all
    assert [g.group_id for g in on_log] == list(sent)
    for g in on_log:
        assert_same_images(sent[g.group_id], g)
        assert [(t.anchors, t.turn_rewards) for t in g.trajectories] == \
            [(t.anchors, t.turn_rewards) for t in sent[g.group_id].trajectories]

    proc = start_replay(port, log_dir)
    try:
        learner = ZmqLearnerReplay(endpoint, key=KEY, timeout=5, arena_bytes=0)
        served = []
        for step in range(2):
            served += learner.sample(step, 0, step, timeout=10)
            learner.ack(step, 0)
        assert sorted(g.group_id for g in served) == sorted(sent)
        for g in served:
            assert_same_images(sent[g.group_id], g)
            assert bytes(encode_group(g)) == bytes(encode_group(sent[g.group_id]))
    finally:
        proc.kill()
        proc.wait()
        actor.close()


def test_a_waiting_learner_and_a_pushing_actor_ride_through_a_restart(tmp_path):
    port, log_dir = free_port(), tmp_path / "log"
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = start_replay(port, log_dir)
    learner = ZmqLearnerReplay(endpoint, key=KEY, timeout=5, check_every=1.0)
    got = []
    waiting = threading.Thread(target=lambda: got.extend(learner.sample(0, 0, 0, timeout=60)))
    waiting.start()  # parked: there is no data yet
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    actor = ZmqActorReplay(endpoint, actor="actor-0", key=KEY, timeout=2)
    pushing = threading.Thread(target=lambda: [actor.push(make_group(seed=i)) for i in range(2)])
    pushing.start()  # the server is down: the push waits and retries
    time.sleep(2.5)
    proc = start_replay(port, log_dir)
    try:
        pushing.join(60)
        waiting.join(60)
        assert not pushing.is_alive() and not waiting.is_alive()
        assert len(got) == 2
    finally:
        proc.kill()
        proc.wait()


def test_pipelined_sends_are_all_delivered_exactly_once_across_a_restart(tmp_path):
    port, log_dir = free_port(), tmp_path / "log"
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = start_replay(port, log_dir)
    actor = ZmqActorReplay(endpoint, actor="actor-0", key=KEY, timeout=2, window=4)
    learner = ZmqLearnerReplay(endpoint, key=KEY, timeout=5, check_every=1.0)
    groups = [make_group(seed=i) for i in range(12)]
    for g in groups[:6]:
        actor.send(g)  # some acknowledged, some still in flight when the server dies
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    sending = threading.Thread(target=lambda: ([actor.send(g) for g in groups[6:]], actor.flush(60)))
    sending.start()  # the window fills; the actor waits, then resends everything unacknowledged
    time.sleep(2.5)
    proc = start_replay(port, log_dir)
    try:
        sending.join(90)
        assert not sending.is_alive() and not actor._unacked
        served = []
        for step in range(6):
            served += [g.group_id for g in learner.sample(step, 0, step, timeout=10)]
            learner.ack(step, 0)
        assert sorted(served) == sorted(g.group_id for g in groups)  # none lost, none twice
        assert learner.stats()["queue_groups"] == 0
    finally:
        proc.kill()
        proc.wait()


def test_consumed_segments_are_removed(tmp_path):
    log = ReplayLog(tmp_path, fsync="never", segment_bytes=3_000)
    log.recover()
    ids = []
    for i in range(12):
        g = make_group(seed=i)
        log.stored(g.group_id, encode_group(g))
        ids.append(g.group_id)
    assert len(log.segments()) >= 4
    log.consumed(ids[:6])
    remaining = log.segments()
    log.consumed(ids[6:])
    assert len(log.segments()) < len(remaining) and len(log.segments()) <= 2
    log.close()
    blobs, seen = ReplayLog(tmp_path).recover()
    assert blobs == [] and len(seen) <= 12


def test_a_torn_tail_record_is_cut_off(tmp_path):
    log = ReplayLog(tmp_path, fsync="always")
    log.recover()
    g = make_group(seed=1)
    log.stored(g.group_id, encode_group(g))
    log.close()
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00garbage")  # a crash mid-write
    blobs, seen = ReplayLog(tmp_path).recover()
    assert len(blobs) == 1 and seen == [g.group_id]


def test_bad_fsync_policy_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="fsync"):
        ReplayLog(tmp_path, fsync="sometimes")


@pytest.mark.parametrize("direct", [True, False])
def test_the_log_reads_back_what_it_wrote_with_and_without_o_direct(tmp_path, direct):
    from replay.arena import Arena

    log = ReplayLog(tmp_path, fsync="always", direct=direct)
    log.recover()
    arena = Arena.create(1 << 20, str(tmp_path))  # a page-aligned blob is written in place
    groups = [make_group(seed=i, length=40 + 997 * i) for i in range(4)]
    blobs = [bytes(encode_group(g)) for g in groups]
    off, view = arena.alloc(len(blobs[1]))
    view[:] = blobs[1]
    log.stored(groups[0].group_id, blobs[0])
    log.stored(groups[1].group_id, view, padded=arena.view(off, (len(blobs[1]) + 4095) // 4096 * 4096))
    log.stored(groups[2].group_id, memoryview(blobs[2]))
    log.consumed([groups[0].group_id])
    log.stored(groups[3].group_id, blobs[3])
    log.close()
    arena.close()
    back, seen = ReplayLog(tmp_path).recover()
    assert [bytes(b) for b in back] == blobs[1:] and seen == [g.group_id for g in groups]


def test_a_segment_of_another_format_is_a_clear_error(tmp_path):
    (tmp_path / "00000001.seg").write_bytes(b"\x10\x00\x00\x00" + b"x" * 100)
    with pytest.raises(RuntimeError, match="not a replay log segment"):
        ReplayLog(tmp_path).recover()


def test_a_resend_that_comes_while_the_original_is_being_logged_is_acknowledged_after_it(tmp_path):
    import zmq

    from replay.buffer import ReplayBuffer
    from replay.server import ReplayServer
    from replay.wire import pack_parts, unpack_parts

    log = ReplayLog(tmp_path, fsync="always")
    srv = ReplayServer(ReplayBuffer(groups_per_step=1, max_staleness=10, log=log), "tcp://127.0.0.1:*")
    srv.start()
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.endpoint)
        blob = encode_group(make_group(seed=1))
        for rid in (1, 2, 3):  # the original and two resends, back to back
            sock.send_multipart(pack_parts("push", [blob], id=rid))
        acks = []  # one log write stores them all: one "acks" message, or one "ack" each
        while len(acks) < 3 and sock.poll(5000):
            reply = unpack_parts(sock.recv_multipart())[0]
            acks += [tuple(a) for a in reply["acks"]] if reply["type"] == "acks" else [(reply["id"], reply["status"])]
        assert acks == [(1, "stored"), (2, "duplicate"), (3, "duplicate")]
        sock.close(0)
        assert srv.snapshot()["queue_groups"] == 1
    finally:
        srv.stop()


def test_a_log_that_cannot_be_written_stops_the_service_loudly_and_acknowledges_nothing(tmp_path):
    from replay.buffer import ReplayBuffer
    from replay.server import ReplayServer

    srv = ReplayServer(ReplayBuffer(groups_per_step=1, max_staleness=10, log=ReplayLog(tmp_path)),
                       "tcp://127.0.0.1:*")
    srv.start()
    try:
        actor = ZmqActorReplay(srv.endpoint, actor="a", timeout=2)
        assert actor.push(make_group(seed=1)) == "stored"
        os.close(srv.buffer.log.log._fd)  # the disk goes away under the log (a failure outside us)
        actor.send(make_group(seed=2))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                srv.snapshot()
            except RuntimeError as exc:
                assert "replay service stopped" in str(exc)
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the service went on without its log")
        assert actor.statuses == {"stored": 1}  # the second group was never acknowledged
    finally:
        srv.stop()


def test_the_log_checksum_catches_every_flipped_bit_and_a_block_of_other_bytes():
    import numpy as np

    from replay.log import BLOCK, checksum

    rng = np.random.default_rng(0)
    data = bytearray(rng.integers(0, 256, 10 * BLOCK + 123, dtype=np.uint8).tobytes())
    h = checksum(data)
    for bit in rng.integers(0, len(data) * 8, 300):  # 300 single-bit flips, anywhere
        data[bit // 8] ^= 1 << (bit % 8)
        assert checksum(data) != h
        data[bit // 8] ^= 1 << (bit % 8)
    assert checksum(data) == h
    for other in (bytes(BLOCK), bytes(data[:BLOCK])):  # a block never written, a block of older bytes
        torn = bytearray(data)
        torn[3 * BLOCK:4 * BLOCK] = other
        assert checksum(torn) != h
    swapped = bytearray(data)
    swapped[BLOCK:2 * BLOCK], swapped[2 * BLOCK:3 * BLOCK] = data[2 * BLOCK:3 * BLOCK], data[BLOCK:2 * BLOCK]
    assert checksum(swapped) != h
    assert checksum(data) == checksum(bytes(data) + bytes(BLOCK - 123))  # the last block is zero-padded


@pytest.mark.parametrize("lost", ["zeros", "older bytes"])
def test_a_record_with_a_block_that_never_reached_the_disk_is_cut_off(tmp_path, lost):
    from replay.log import BLOCK, MAGIC

    log = ReplayLog(tmp_path, fsync="always")
    log.recover()
    groups = [make_group(seed=s) for s in (1, 2)]
    for g in groups:
        log.stored(g.group_id, encode_group(g))
    log.close()
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    assert data.startswith(MAGIC)
    second = data.rindex(b"\x00" * 16 + bytes(encode_group(groups[1]))[:64]) + 16  # the 2nd blob's start
    assert second % BLOCK == 0
    data[second:second + BLOCK] = bytes(BLOCK) if lost == "zeros" else data[BLOCK:2 * BLOCK]
    seg.write_bytes(bytes(data))
    blobs, seen = ReplayLog(tmp_path).recover()  # a crash tore the last record: it is cut off
    assert [bytes(b) for b in blobs] == [bytes(encode_group(groups[0]))] and seen == [groups[0].group_id]
    assert seg.stat().st_size < len(data)


def test_the_standalone_service_refuses_the_launchers_node_address():
    run = subprocess.run([sys.executable, "-m", "replay.server", "--replay.host", "node"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "--replay.host node is for parts the launcher places on Ray" in run.stderr
