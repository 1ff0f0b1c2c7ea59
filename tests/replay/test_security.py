"""Bad peers: fuzzed frames, unsigned or tampered frames. The server keeps serving."""

import numpy as np
import pytest
import zmq

from replay.buffer import ReplayBuffer
from replay.client import ZmqReplayClient
from replay.server import ReplayServer
from replay.wire import MAC_BYTES, WireError, encode_group, pack, sign, unpack
from tests.replay.helpers import make_group

KEY = bytes(range(32))


@pytest.fixture
def server():
    srv = ReplayServer(ReplayBuffer(groups_per_step=2, max_staleness=4), "tcp://127.0.0.1:*", key=KEY)
    srv.start()
    yield srv
    srv.stop()


def dealer(endpoint):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def fuzz_frames(n: int, rng: np.random.Generator) -> list[list[bytes]]:
    """Random bytes, random msgpack, truncations and bit flips of valid signed frames, forged MACs."""
    valid = [pack("push", key=KEY, id=1, group=encode_group(make_group(seed=1))),
             pack("sample", key=KEY, id=2, step=0, rank=0, version=0),
             pack("credit", key=KEY, id=3, actor="a")]
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append([rng.bytes(int(rng.integers(0, 300)))])
        elif kind == 1:
            base = valid[int(rng.integers(len(valid)))]
            out.append([base[: int(rng.integers(0, len(base)))]])
        elif kind == 2:
            frame = bytearray(valid[int(rng.integers(len(valid)))])
            for _ in range(int(rng.integers(1, 4))):
                frame[int(rng.integers(len(frame)))] ^= 1 << int(rng.integers(8))
            out.append([bytes(frame)])
        elif kind == 3:  # well signed, wrong content
            body = {"v": 1, "type": ["push", "sample", "ack", "credit", "hello"][i % 5], "id": i,
                    "group": rng.bytes(50), "step": -1, "rank": "x", "actor": 7}
            import msgpack
            out.append([sign(KEY, msgpack.packb(body))])
        elif kind == 4:  # signed with another key
            out.append([sign(b"k" * 32, valid[0][MAC_BYTES:])])
        else:
            out.append([rng.bytes(10) for _ in range(int(rng.integers(2, 4)))])
    return out


def test_ten_thousand_bad_frames_then_a_normal_client_is_served(server):
    rng = np.random.default_rng(0)
    sock = dealer(server.endpoint)
    replies = 0
    for frames in fuzz_frames(10_000, rng):
        sock.send_multipart(frames)
        while sock.poll(0):
            sock.recv()
            replies += 1
    while sock.poll(500):
        sock.recv()
        replies += 1
    sock.close(0)
    stats = server.snapshot()
    assert stats["malformed_frames"] >= 9_000 and replies >= 9_000
    assert stats["queue_groups"] == 0  # no corrupted group got in
    client = ZmqReplayClient(server.endpoint, actor="a", key=KEY)
    groups = [make_group(seed=10 + i, actor="a") for i in range(2)]
    assert [client.push(g) for g in groups] == ["stored", "stored"]
    got = client.sample(step=0, rank=0, version=0, timeout=10)
    assert sorted(g.group_id for g in got) == sorted(g.group_id for g in groups)


def test_unsigned_and_tampered_frames_are_rejected_signed_ones_pass(server):
    sock = dealer(server.endpoint)
    body = pack("push", id=1, group=encode_group(make_group(seed=3)))
    sock.send(body)  # unsigned
    reply = unpack(sock.recv(), key=KEY) if sock.poll(5000) else None
    assert reply["type"] == "error" and "HMAC" in reply["reason"]
    signed = bytearray(sign(KEY, body))
    signed[-5] ^= 0xFF  # tampered after signing
    sock.send(bytes(signed))
    reply = unpack(sock.recv(), key=KEY) if sock.poll(5000) else None
    assert reply["type"] == "error" and "HMAC" in reply["reason"]
    sock.send(sign(KEY, body))
    reply = unpack(sock.recv(), key=KEY) if sock.poll(5000) else None
    assert reply["type"] == "ack" and reply["status"] == "stored"
    sock.close(0)
    assert server.snapshot()["malformed_frames"] == 2


def test_a_client_without_the_key_cannot_read_replies(server):
    stranger = ZmqReplayClient(server.endpoint, actor="x", timeout=2)
    with pytest.raises(WireError):
        stranger.hello()


def test_oversized_frames_are_refused_before_decoding():
    from replay.wire import MAX_FRAME

    with pytest.raises(WireError, match="cap"):
        unpack(b"\x00" * (MAX_FRAME + 1), key=KEY)
