"""Bad peers: fuzzed frames, unsigned or tampered frames. The server keeps serving."""

import numpy as np
import pytest
import zmq

from replay.buffer import ReplayBuffer
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.server import ReplayServer
from replay.wire import WireError, encode_group, pack_parts, unpack, unpack_parts
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
    """Random bytes, random msgpack, truncations and bit flips of valid signed messages, forged MACs."""
    import msgpack

    valid = [pack_parts("push", [encode_group(make_group(seed=1))], key=KEY, id=1),
             pack_parts("sample", key=KEY, id=2, step=0, rank=0, version=0),
             pack_parts("credit", key=KEY, id=3, actor="a")]
    out = []
    for i in range(n):
        kind = i % 6
        base = [bytes(p) for p in valid[int(rng.integers(len(valid)))]]
        if kind == 0:
            out.append([rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 4)))])
        elif kind == 1:  # truncated frames, or frames missing
            j = int(rng.integers(len(base)))
            out.append(base[:j] + [base[j][: int(rng.integers(0, len(base[j])))]])
        elif kind == 2:  # bit flips anywhere
            j = int(rng.integers(len(base)))
            frame = bytearray(base[j])
            for pos in rng.choice(len(frame), size=min(len(frame), int(rng.integers(1, 4))), replace=False):
                frame[int(pos)] ^= 1 << int(rng.integers(8))  # distinct positions: never a no-op
            out.append(base[:j] + [bytes(frame)] + base[j + 1:])
        elif kind == 3:  # well signed, wrong content
            body = {"v": 1, "type": ["push", "sample", "ack", "credit", "hello"][i % 5], "id": i, "blobs": 1,
                    "step": -1, "rank": "x", "actor": 7}
            from replay.wire import _mac
            parts = [msgpack.packb(body), rng.bytes(64)]
            out.append([_mac(KEY, parts), *parts])
        elif kind == 4:  # signed with another key
            out.append(pack_parts("credit", key=b"k" * 32, id=5, actor="a"))
        else:  # a valid signature on random frames: the MAC must cover frame boundaries
            out.append([base[0], rng.bytes(20), rng.bytes(10)])
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
    client = ZmqActorReplay(server.endpoint, actor="a", key=KEY)
    groups = [make_group(seed=10 + i, actor="a") for i in range(2)]
    assert [client.push(g) for g in groups] == ["stored", "stored"]
    got = ZmqLearnerReplay(server.endpoint, key=KEY).sample(step=0, rank=0, version=0, timeout=10)
    assert sorted(g.group_id for g in got) == sorted(g.group_id for g in groups)


def test_unsigned_and_tampered_messages_are_rejected_signed_ones_pass(server):
    sock = dealer(server.endpoint)

    def ask(parts):
        sock.send_multipart(parts)
        assert sock.poll(5000)
        return unpack_parts(sock.recv_multipart(), key=KEY)[0]

    blob = encode_group(make_group(seed=3))
    unsigned = pack_parts("push", [blob], id=1)
    reply = ask(unsigned)
    assert reply["type"] == "error" and "HMAC" in reply["reason"]
    signed = pack_parts("push", [blob], key=KEY, id=2)
    tampered = bytearray(signed[2])
    tampered[-5] ^= 0xFF
    reply = ask([signed[0], signed[1], bytes(tampered)])
    assert reply["type"] == "error" and "HMAC" in reply["reason"]
    reply = ask(signed)
    assert reply["type"] == "ack" and reply["status"] == "stored"
    sock.close(0)
    assert server.snapshot()["malformed_frames"] == 2


def test_a_client_without_the_key_cannot_read_replies(server):
    stranger = ZmqActorReplay(server.endpoint, actor="x", timeout=2)
    with pytest.raises(WireError):
        stranger.hello()


def test_oversized_frames_are_refused_before_decoding():
    from replay.wire import MAX_FRAME

    with pytest.raises(WireError, match="cap"):
        unpack(b"\x00" * (MAX_FRAME + 1), key=KEY)
