"""The weight channel's messages (msgspec Structs with bounds), the transport factories, and the
in-process channel that tests and one-process runs use instead of sockets."""

import msgspec
import pytest
import torch

from policy.adapter import Adapter
from weights import wire
from weights.chunks import BrokenAdapter, read_chunk, read_news
from weights.local import InProcessWeights
from weights.publisher import WeightPublisher
from weights.subscriber import WeightSubscriber
from weights.transports import ShmReceiver, ShmSender, SocketReceiver, SocketSender, make_receivers, make_senders

KEY = bytes(range(32))


def raw(key=KEY, **fields) -> bytes:
    return wire.sign(key, msgspec.msgpack.encode({"v": wire.SCHEMA, **fields}))


def header(**changes) -> dict:
    fields = dict(type="adapter_chunk.v3", version=1, index=0, count=1, total=3, frames=1, mac=bytes(32),
                  base_model="base", config={})
    return {**fields, **changes}


def test_every_message_round_trips_signed():
    messages = [wire.ChunkHeader(version=2, index=0, count=3, total=10, frames=2, mac=bytes(32), base_model="m",
                                 config={"r": 8}),
                wire.Commit(version=2, count=3, total=10, digest=bytes(32)),
                wire.ShmNote(version=2, name="tandem-weights-12-0123456789abcdef", size=10, host="h",
                             base_model="m", config={}),
                wire.Latest(), wire.Nothing()]
    for message in messages:
        assert wire.decode(wire.encode(message, KEY), KEY) == message
    with pytest.raises(wire.WireError, match="unsigned"):
        wire.decode(wire.encode(messages[0]), KEY)
    with pytest.raises(wire.WireError, match="unexpected frame type 'latest'"):
        wire.decode(wire.encode(wire.Latest(), KEY), KEY, (wire.Commit,))


@pytest.mark.parametrize("changes, field", [({"count": 0}, "count"), ({"mac": bytes(31)}, "mac"),
                                            ({"index": -1}, "index"), ({"frames": "two"}, "frames"),
                                            ({"base_model": "x" * 5000}, "base_model")])
def test_a_signed_header_out_of_its_bounds_is_a_broken_adapter_naming_the_field(changes, field):
    with pytest.raises(BrokenAdapter, match=rf"adapter version 1: .*\$\.{field}"):
        read_chunk([raw(**header(**changes)), b"abc"], KEY)


def test_strangers_and_garbage_are_wire_errors_not_broken_adapters():
    cases = [b"garbage", raw(type="push"), raw(**header(version="one")), raw(key=b"other", **header()),
             wire.sign(KEY, msgspec.msgpack.encode({"v": 2, **header()})), b"x" * (wire.MAX_FRAME + 1)]
    for frame in cases:
        with pytest.raises(wire.WireError) as info:
            read_chunk([frame, b"abc"], KEY)
        assert not isinstance(info.value, BrokenAdapter), frame[:40]
    with pytest.raises(BrokenAdapter, match="index 1, count 1"):  # bounds between fields: the reader's
        read_chunk([raw(**header(index=1)), b"abc"], KEY)
    with pytest.raises(BrokenAdapter, match=r"adapter version 3: its adapter_shm.v3 breaks the schema.*\$\.name"):
        read_news(raw(type="adapter_shm.v3", version=3, name="../../etc/passwd", size=1, host="h",
                      base_model="b", config={}), KEY)


def test_transports_are_chosen_by_name():
    assert [type(s) for s in make_senders("socket", lambda parts: None, KEY)] == [SocketSender]
    senders = make_senders("shm", lambda parts: None, KEY)
    assert [type(s) for s in senders] == [ShmSender, SocketSender]
    senders[0].close()
    assert [type(r) for r in make_receivers("shm", KEY, 1.0, None, lambda: None)] == [ShmReceiver, SocketReceiver]
    assert [type(r) for r in make_receivers("socket", KEY, 1.0, None, lambda: None)] == [SocketReceiver]
    for bad in (lambda: make_senders("udp", lambda parts: None, KEY),
                lambda: make_receivers("udp", KEY, 1.0, None, lambda: None),
                lambda: WeightPublisher(transport="udp"), lambda: WeightSubscriber(("tcp://a:1", "tcp://a:2"),
                                                                                   transport="udp")):
        with pytest.raises(ValueError, match="weight transport 'udp': choose one of"):
            bad()


def test_a_socket_publisher_writes_no_shared_memory(closing):
    publisher = WeightPublisher(key=KEY, transport="socket")
    closing(publisher)
    assert publisher.shm is None


def test_the_in_process_channel_delivers_the_newest_version_once():
    weights = InProcessWeights()
    early, tensors = weights.subscriber(), {"a.lora_A.weight": torch.ones(2, 3)}
    assert early.poll() is None and early.latest(0) is None and early.wait(0.01) is None
    assert weights.publish(Adapter(0, "base", {}, tensors)) == 24
    weights.publish(Adapter(1, "base", {}, tensors))
    got = early.poll()
    assert got.version == 1 and got.tensors is tensors  # the same tensors: nothing crosses a process
    assert early.poll() is None
    late = weights.subscriber()  # a restarted actor asks for the current adapter
    assert late.latest(1).version == 1 and late.wait(0.01) is None
    with pytest.raises(ValueError, match="no tensors"):
        weights.publish(Adapter(2, "base", {}, {}))
