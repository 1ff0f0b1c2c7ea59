"""The weight channel over real ZeroMQ sockets: chunked adapters of any size, the wire dtype,
the newest version winning, and what happens to broken adapters and strangers' frames. Publishers
here run with `transport="socket"` where the socket path is under test (subscribers on other hosts);
tests/weights/test_shm.py has the same-host path."""

import threading
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from policy.adapter import Adapter
from weights import wire
from weights.chunks import BrokenAdapter, chunk_messages, decode_adapter, encode_adapter
from weights.format import from_safetensors, to_safetensors
from weights.publisher import WeightPublisher
from weights.subscriber import AdapterUndeliverable, WeightSubscriber
from weights.transports import DATA, NEWS

KEY = bytes(range(32))


def pack(msg_type: str, *, key: bytes | None = None, **fields) -> bytes:
    """A signed frame of any type and fields, not checked against the schema (as a stranger or
    an older Tandem would send it)."""
    return wire.sign(key, msgspec.msgpack.encode({"v": wire.SCHEMA, "type": msg_type, **fields}))

TINY = {"x.lora_A.weight": torch.zeros(1, 2)}


def lora(nbytes: int, seed: int = 0, width: int = 1000) -> dict:
    """fp32 tensors of about `nbytes` in all, with odd sizes so that tensors straddle chunks."""
    gen = torch.Generator().manual_seed(seed)
    rows = max(1, nbytes // (4 * width) // 6)
    return {f"layers.{i}.q_proj.lora_{ab}.weight": torch.randn(rows + i, width, generator=gen)
            for i in range(3) for ab in "AB"}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def sync(send, subs, deadline: float = 20.0) -> None:
    """Send a one-chunk version 0 until every subscriber has it: their SUB sockets are connected."""
    end = time.monotonic() + deadline
    while any(s.version < 0 for s in subs):
        assert time.monotonic() < end, "the subscribers never received anything"
        send(Adapter(0, "tiny", {}, TINY))
        time.sleep(0.05)
        for s in subs:
            s.poll()


class RawPub:
    """A test double for the publisher's PUB side: sends whatever chunk messages it is given."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, messages) -> None:
        for parts in messages:  # on the publisher's topics: commits are news, chunks data
            self.sock.send_multipart([NEWS if len(parts) == 1 else DATA, *parts])

    def send_adapter(self, adapter: Adapter) -> None:
        self.send(encode_adapter(adapter, KEY, chunk_bytes=1 << 20))


class RawLatest:
    """A test double for the publisher's "latest" side: answers every request with `parts`."""

    def __init__(self, parts: list) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.parts, self.requests, self.stop = parts, 0, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                ident, _ = self.sock.recv_multipart()
                self.requests += 1
                self.sock.send_multipart([ident, *self.parts])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)


def corrupt(messages, index: int) -> list:
    """The chunk messages with one byte of chunk `index`'s data flipped (its signed header intact)."""
    out = [list(parts) for parts in messages]
    data = bytearray(out[index][1])
    data[len(data) // 2] ^= 0xFF
    out[index][1] = bytes(data)
    return out


def flat(messages) -> list:
    return [part for parts in messages for part in parts]


def test_adapter_over_the_frame_cap_reaches_every_subscriber_and_latest(monkeypatch, closing):
    monkeypatch.setattr(wire, "MAX_FRAME", 1 << 20)  # a 1 MiB cap keeps the test light
    tensors = lora(5 << 20)
    publisher = WeightPublisher(key=KEY, chunk_bytes=300_000, transport="socket")
    closing(publisher)
    subs = [WeightSubscriber(publisher.endpoints, key=KEY) for _ in range(2)]
    for s in subs:
        closing(s)
    sync(publisher.publish, subs)
    size = publisher.publish(Adapter(1, "base", {"r": 8}, tensors))
    assert size > wire.MAX_FRAME
    for s in subs:
        adapter = s.wait(20)
        assert adapter is not None and (adapter.version, adapter.base_model, adapter.config) == (1, "base", {"r": 8})
        assert_same(adapter.tensors, tensors)
        assert s.rejected == 0
    late = WeightSubscriber(publisher.endpoints, key=KEY)
    closing(late)
    assert late.poll() is None
    adapter = late.latest(timeout=20)
    assert adapter is not None and adapter.version == 1
    assert_same(adapter.tensors, tensors)
    assert late.latest(timeout=20) is None  # nothing newer than what it has


def test_a_subscriber_that_joins_later_learns_of_the_adapter_from_the_announcements(closing):
    publisher = WeightPublisher(key=KEY, announce_s=0.1, transport="socket")
    closing(publisher)
    tensors = lora(100_000)
    publisher.publish(Adapter(4, "base", {}, tensors))
    late = WeightSubscriber(publisher.endpoints, key=KEY)  # missed the chunks: connected afterwards
    closing(late)
    adapter = late.wait(20)
    assert adapter is not None and adapter.version == 4
    assert_same(adapter.tensors, tensors)


def test_a_real_adapter_over_64_mib(closing):
    tensors = lora(70 << 20)  # ~70 MiB of fp32, over the real frame cap
    publisher = WeightPublisher(key=KEY, transport="socket")  # the socket, as to actors on other hosts
    closing(publisher)
    subs = [WeightSubscriber(publisher.endpoints, key=KEY) for _ in range(2)]
    for s in subs:
        closing(s)
    sync(publisher.publish, subs)
    assert publisher.publish(Adapter(1, "base", {}, tensors)) > wire.MAX_FRAME
    for s in subs:
        adapter = s.wait(60)
        assert adapter is not None and adapter.version == 1
        assert_same(adapter.tensors, tensors)
    late = WeightSubscriber(publisher.endpoints, key=KEY)
    closing(late)
    adapter = late.latest(timeout=60)
    assert adapter is not None and adapter.version == 1
    assert_same(adapter.tensors, tensors)


def test_bf16_on_the_wire(closing):
    tensors = {"a.lora_A.weight": torch.randn(7, 33), "a.lora_B.weight": torch.randn(33, 7) * 1e3,
               "steps": torch.arange(5)}  # not floating: travels as it is
    publisher = WeightPublisher(key=KEY, dtype="bfloat16", transport="socket")
    sub = WeightSubscriber(publisher.endpoints, key=KEY)
    closing(publisher), closing(sub)
    sync(publisher.publish, [sub])
    publisher.publish(Adapter(1, "base", {}, tensors))
    adapter = sub.wait(20)
    assert adapter is not None
    assert_same(adapter.tensors, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()})
    as_given = decode_adapter(encode_adapter(Adapter(1, "base", {}, tensors)))
    assert_same(as_given.tensors, tensors)
    with pytest.raises(ValueError, match="wire dtype"):
        WeightPublisher(dtype="fp8")


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def test_tensors_travel_from_their_own_memory_and_arrive_as_views():
    """No copy on either side: every tensor already in the wire dtype is sent as frames of its own
    memory, and decoding gives views of the frames, except the few tensors that straddle chunks."""
    tensors = {k: v.bfloat16() for k, v in lora(3 << 20).items()}
    messages = encode_adapter(Adapter(2, "base", {}, tensors), KEY, dtype="bfloat16", chunk_bytes=1 << 20)
    frames = {_address(part) for parts in messages[:-1] for part in parts[1:]}
    assert all(t.data_ptr() in frames for t in tensors.values())
    assert all(len(parts) - 1 == wire.decode(parts[0], KEY, (wire.ChunkHeader,)).frames
               for parts in messages[:-1])
    back = decode_adapter(messages, KEY)
    assert_same(back.tensors, tensors)
    views = [k for k, v in back.tensors.items() if v.data_ptr() == tensors[k].data_ptr()]
    assert len(views) >= len(tensors) - (len(messages) - 2)  # at most one straddler a chunk boundary


def test_tensors_to_cast_or_not_contiguous_or_empty_travel_as_converted_copies():
    tensors = {"t": torch.randn(6, 40).t(), "b": torch.randn(50).bfloat16(), "h": torch.randn(9).half(),
               "i": torch.arange(7), "e": torch.empty(0, 3), "s": torch.tensor(3.0)}
    for dtype in (None, "bfloat16", "float32"):
        want = {k: v.to(getattr(torch, dtype)) if dtype and v.is_floating_point() else v for k, v in tensors.items()}
        back = decode_adapter(encode_adapter(Adapter(1, "base", {}, tensors), KEY, dtype=dtype, chunk_bytes=256), KEY)
        assert_same(back.tensors, want)
        if dtype is None:  # a non-contiguous tensor is never sent from its own (strided) memory
            assert back.tensors["t"].data_ptr() != tensors["t"].data_ptr()


def test_a_chunk_without_the_frames_its_header_counts_is_broken():
    messages = encode_adapter(Adapter(3, "base", {}, lora(100_000)), KEY, chunk_bytes=1 << 20)
    assert len(messages[0]) > 2  # the header, then the JSON header's piece and tensors' own frames
    short = [messages[0][:-1], *messages[1:]]
    with pytest.raises(BrokenAdapter, match=f"chunk 0 came with {len(messages[0]) - 2} data frames, its header says"):
        decode_adapter(short, KEY)


def test_versions_published_quickly_end_on_the_newest_and_never_go_back(closing):
    publisher = WeightPublisher(key=KEY, chunk_bytes=64 << 10, hwm=8, transport="socket")  # 4 chunks an adapter, a short queue
    sub = WeightSubscriber(publisher.endpoints, key=KEY, hwm=2, stall_s=1.0)
    closing(publisher), closing(sub)
    sync(publisher.publish, [sub])
    newest = {}
    for version in range(1, 31):
        newest = lora(200_000, seed=version, width=100)
        publisher.publish(Adapter(version, "base", {}, newest))
    seen, deadline = [], time.monotonic() + 60
    while sub.version < 30 and time.monotonic() < deadline:
        adapter = sub.wait(1)
        if adapter is not None:
            seen.append(adapter)
    assert seen and seen[-1].version == 30
    assert all(a.version < b.version for a, b in zip(seen, seen[1:]))
    assert_same(seen[-1].tensors, newest)
    publisher.publish(Adapter(29, "base", {}, lora(1000, seed=29, width=100)))  # an older version: ignored
    assert sub.wait(0.5) is None and sub.version == 30


def test_a_corrupt_or_missing_chunk_is_fetched_again_from_latest(closing):
    tensors = lora(3 << 20)
    publisher = WeightPublisher(key=KEY)  # holds the good copy of version 3 for `latest`
    fake = RawPub()  # sends broken copies of it on PUB
    closing(publisher), closing(fake.sock)
    publisher.publish(Adapter(3, "base", {}, tensors))
    messages = encode_adapter(Adapter(3, "base", {}, tensors), KEY, chunk_bytes=1 << 20)
    assert len(messages) >= 4  # 3 chunks or more, then the commit
    broken = {"corrupt": corrupt(messages, 1), "missing": messages[:1] + messages[2:], "tail lost": messages[:-2],
              "commit lost": messages[:-1], "all lost, then committed": messages[-1:]}
    for name, sent in broken.items():
        sub = WeightSubscriber((fake.endpoint, publisher.endpoints[1]), key=KEY, stall_s=0.5)
        closing(sub)
        sync(fake.send_adapter, [sub])
        fake.send(sent)
        adapter = sub.wait(20)
        assert adapter is not None and adapter.version == 3, name
        assert_same(adapter.tensors, tensors)
        assert sub.rejected == 0


def test_an_adapter_that_cannot_be_delivered_raises_with_the_reason(closing):
    tensors = lora(3 << 20)
    messages = encode_adapter(Adapter(3, "base", {}, tensors), KEY, chunk_bytes=1 << 20)
    not_safetensors = chunk_messages(memoryview(b"not safetensors" * 99_999), 3, "base", {}, KEY, 1 << 20)
    cases = [(corrupt(messages, 1), f"chunk 1 of {len(messages) - 1} does not match its digest"),
             (not_safetensors, "not safetensors")]
    fake = RawPub()
    closing(fake.sock)
    for sent, reason in cases:
        latest = RawLatest(flat(sent))  # the publisher's stored copy is broken too
        closing(latest)
        sub = WeightSubscriber((fake.endpoint, latest.endpoint), key=KEY, retries=2, timeout=5)
        closing(sub)
        sync(fake.send_adapter, [sub])
        fake.send(sent)
        with pytest.raises(AdapterUndeliverable, match="adapter version 3") as info:
            sub.wait(20)
        assert reason in str(info.value) and "Check that" in str(info.value)
        assert latest.requests == 2 and sub.version == 0
        with pytest.raises(AdapterUndeliverable, match=reason):
            sub.latest(timeout=5)


def test_a_missing_chunk_and_no_publisher_to_ask_raises(closing):
    fake = RawPub()
    closing(fake.sock)
    gone = zmq.Context.instance().socket(zmq.ROUTER)
    gone.bind("tcp://127.0.0.1:*")
    endpoint = gone.getsockopt_string(zmq.LAST_ENDPOINT)
    gone.close(0)  # nobody answers `latest` there any more
    sub = WeightSubscriber((fake.endpoint, endpoint), key=KEY, retries=2, timeout=0.3)
    closing(sub)
    sync(fake.send_adapter, [sub])
    messages = encode_adapter(Adapter(2, "base", {}, lora(3 << 20)), KEY, chunk_bytes=1 << 20)
    fake.send(messages[:1] + messages[2:])
    count = len(messages) - 1  # the last message is the commit
    with pytest.raises(AdapterUndeliverable, match=f"chunks 1 of {count} never arrived.*no answer to 'latest'"):
        sub.wait(20)


def test_strangers_frames_are_rejected_and_counted(closing):
    fake = RawPub()
    closing(fake.sock)
    sub = WeightSubscriber((fake.endpoint, "tcp://127.0.0.1:9"), key=KEY)
    closing(sub)
    sync(fake.send_adapter, [sub])
    good = encode_adapter(Adapter(1, "base", {}, TINY), KEY)
    strangers = [[b"garbage"], [b"garbage", b"more"], *encode_adapter(Adapter(1, "base", {}, TINY)),  # unsigned
                 *encode_adapter(Adapter(1, "base", {}, TINY), b"another key"),
                 [pack("adapter_chunk.v3", key=KEY, version="one"), b""],  # no valid version
                 [good[0][0][:-1] + bytes([good[0][0][-1] ^ 1]), good[0][1]],  # altered after signing
                 [pack("push", key=KEY), b"x"]]
    before = sub.rejected
    fake.send(strangers)
    deadline = time.monotonic() + 20
    while sub.rejected - before < len(strangers) and time.monotonic() < deadline:
        assert sub.wait(0.05) is None
    assert sub.rejected - before == len(strangers) and sub.version == 0
    fake.send(good)
    adapter = sub.wait(20)  # the channel still works
    assert adapter is not None and adapter.version == 1


def test_a_subscriber_with_the_wrong_key_rejects_everything(closing):
    publisher = WeightPublisher(key=KEY, chunk_bytes=100_000, transport="socket")
    sub = WeightSubscriber(publisher.endpoints, key=b"not the run key")
    closing(publisher), closing(sub)
    deadline = time.monotonic() + 20
    while sub.rejected < 3 and time.monotonic() < deadline:
        publisher.publish(Adapter(1, "base", {}, lora(250_000)))
        sub.wait(0.2)
    assert sub.rejected >= 3 and sub.version == -1
    assert sub.latest(timeout=0.5) is None  # the publisher does not answer strangers


def test_an_empty_adapter_is_refused():
    publisher = WeightPublisher()
    try:
        with pytest.raises(ValueError, match="no tensors"):
            publisher.publish(Adapter(1, "base", {}, {}))
    finally:
        publisher.close()


def test_chunks_grow_so_that_two_adapters_fit_the_queue(closing):
    publisher = WeightPublisher(key=KEY, chunk_bytes=10_000, hwm=6, transport="socket")
    sub = WeightSubscriber(publisher.endpoints, key=KEY)
    closing(publisher), closing(sub)
    messages = encode_adapter(Adapter(1, "b", {}, lora(100_000)), KEY, chunk_bytes=10_000, max_chunks=3)
    assert len(messages) == 3 + 1  # 3 chunks, then the commit
    sync(publisher.publish, [sub])
    tensors = lora(100_000)
    publisher.publish(Adapter(1, "b", {}, tensors))
    adapter = sub.wait(20)
    assert adapter is not None and adapter.version == 1
    assert_same(adapter.tensors, tensors)


def test_safetensors_bytes_are_what_the_library_reads_and_writes():
    """We write and read the format ourselves (no copies); the library must agree, both ways."""
    from safetensors.torch import load, save

    tensors = {"b": torch.randn(3, 5), "a": torch.arange(7), "h": torch.randn(4).half(), "z": torch.empty(0, 3),
               "s": torch.tensor(2.0), "m": torch.ones(2, dtype=torch.bool), "c": torch.randn(9).bfloat16()}
    assert_same(load(bytes(to_safetensors(tensors))), tensors)
    theirs = save(tensors)
    for cut in (1, 7, 64, len(theirs)):  # split across buffers at every kind of place
        pieces = [bytearray(theirs[i:i + cut]) for i in range(0, len(theirs), cut)]
        assert_same(from_safetensors(pieces), tensors)
    bad = bytearray(theirs)
    bad[8:9] = b"!"  # no longer JSON
    with pytest.raises(ValueError, match="not JSON"):
        from_safetensors([bad])
    with pytest.raises(ValueError, match="runs past"):
        from_safetensors([theirs[:40]])
    head = (b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
            b'"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}')
    with pytest.raises(ValueError, match="hole or an overlap"):
        from_safetensors([len(head).to_bytes(8, "little") + head + bytes(8)])


OLD_FORMATS = {1: [pack("adapter_chunk", key=KEY, version=2, index=0, count=1, total=3, digest=bytes(32),
                              sha=bytes(32), base_model="base", config={}), b"abc"],
               2: [pack("adapter_chunk.v2", key=KEY, version=2, index=0, count=1, total=3, mac=bytes(32),
                              base_model="base", config={}), b"abc"]}


@pytest.mark.parametrize("number", sorted(OLD_FORMATS))
def test_an_adapter_in_an_old_format_stops_with_a_message_that_names_it(closing, number):
    """Formats 1 (SHA-256 digests) and 2 (one data frame a chunk) are never read as format 3, nor
    dropped silently as a stranger's."""
    fake = RawPub()
    closing(fake.sock)
    old = OLD_FORMATS[number]
    latest = RawLatest(old)  # an older learner answers `latest` in format 1 too
    closing(latest)
    sub = WeightSubscriber((fake.endpoint, latest.endpoint), key=KEY, retries=2, timeout=5)
    closing(sub)
    sync(fake.send_adapter, [sub])
    fake.send([old])
    with pytest.raises(AdapterUndeliverable, match=f"adapter version 2.*format {number}.*older Tandem"):
        sub.wait(20)
