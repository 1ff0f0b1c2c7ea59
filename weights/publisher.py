"""The weight channel's learner end: each adapter version published to every subscriber.

The learner is handed a `Publisher` (as it is handed a replay client) and calls `publish` after
each optimizer step; the launcher builds a `WeightPublisher` on learner rank 0, tests and
one-process runs an `InProcessWeights` (weights/local.py).

`WeightPublisher` binds a PUB socket (every subscriber gets each new version as it is published)
and a ROUTER socket that answers "latest" requests with the current adapter, all its chunks in one
multipart reply: a PUB socket drops messages to late joiners, so a new or restarted actor asks
for the current adapter when it starts. Each version goes out on the data paths of its
`transport` (weights/transports.py: shared memory on this host, chunks on the socket); after the
chunks, and then every `announce_s`, the newest version's commit (one small signed frame on the
same PUB socket, so it arrives after every chunk of that version that was not dropped).

High-water marks count messages (chunks), and libzmq fixes a bound socket's when it binds, before
any adapter is seen. So the publisher's `hwm` (64 chunks: 1 GiB at 16 MiB) stays put and the
chunks grow instead (up to the frame cap) for an adapter that would need more than hwm / 2 of
them: two adapters always fit one subscriber's queue, so one that keeps up loses nothing, while
one that stops reading holds at most `hwm` chunks of the publisher's memory, then loses chunks
(and asks for `latest` when it reads again), never unbounded old versions. Reasons and
measurements: docs/weights.md.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import zmq

from policy.adapter import Adapter
from weights import wire
from weights.chunks import CHUNK_BYTES, WIRE_DTYPES, layout
from weights.shm import ShmWriter
from weights.transports import NEWS, ShmSender, SocketSender, make_senders
from weights.wire import Latest, Nothing, WireError, advertised


class Publisher(Protocol):
    """What the learner publishes adapters through (rank 0 has one; other ranks none).

    Usage::

        publisher = WeightPublisher(host, key=run_key)      # the launcher builds it
        learner = Learner(cfg, ..., replay, publisher=publisher)
        size = publisher.publish(adapter)                   # after each optimizer step
        publisher.close()                                   # whoever built it closes it
    """

    def publish(self, adapter: Adapter) -> int:
        """Send `adapter` to every subscriber and keep it for "latest"; its size in bytes. The
        caller hands the tensors over and never changes them afterwards (a snapshot)."""

    def close(self) -> None:
        """Stop publishing and release sockets, threads and files."""


class WeightPublisher:
    """Learner rank 0's end over ZeroMQ. `publish` is called from one thread; a helper thread
    answers `latest` and repeats the newest commit.

    Usage::

        publisher = WeightPublisher(host, key=run_key, dtype="bfloat16")
        endpoints = publisher.endpoints               # (pub, latest): what subscribers connect to
        publisher.publish(Adapter(version, base_model, lora_config, tensors))   # after each step
        publisher.close()

    `dtype` casts floating tensors for the wire (one of WIRE_DTYPES); `chunk_bytes` is the chunk
    size; `hwm` the chunks each subscriber's queue holds (fixed at bind); `announce_s` the period
    of the announcements of the newest version; `advertise` the address subscribers reach (for a
    `host` of "0.0.0.0", one of this node's addresses); `transport` the data paths ("shm": shared
    memory for subscribers on this host, chunks for the others; "socket": chunks alone), `host_key`
    saying which host this is (default: the boot id)."""

    def __init__(self, host: str = "127.0.0.1", pub_port: int = 0, req_port: int = 0,
                 key: bytes | None = None, *, dtype: str | None = None, chunk_bytes: int = CHUNK_BYTES,
                 hwm: int = 64, announce_s: float = 1.0, advertise: str | None = None, transport: str = "shm",
                 host_key: str | None = None) -> None:
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {dtype!r}: choose one of {WIRE_DTYPES}")
        if not 0 < chunk_bytes <= wire.MAX_FRAME:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be 1 to the frame cap ({wire.MAX_FRAME})")
        if hwm < 2:
            raise ValueError(f"hwm={hwm}: the publisher's queue must hold at least 2 chunks")
        self.key, self.dtype, self.chunk_bytes, self.hwm, self.announce_s = key, dtype, chunk_bytes, hwm, announce_s
        self._lock = threading.Lock()  # the PUB socket: `publish` sends chunks, the helper thread announcements
        self._senders = make_senders(transport, self._send, key, host_key)
        self._socket: SocketSender = self._senders[-1]
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)  # libzmq fixes it when binding: never changed later
        self._pub.bind(f"tcp://{host}:{pub_port or '*'}")
        self._stop = threading.Event()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(f"tcp://{host}:{req_port or '*'}")
        self.endpoints = (advertised(self._pub.getsockopt_string(zmq.LAST_ENDPOINT), advertise),
                          advertised(self._router.getsockopt_string(zmq.LAST_ENDPOINT), advertise))
        self._thread = threading.Thread(target=self._serve, name="weights-latest", daemon=True)
        self._thread.start()

    @property
    def shm(self) -> ShmWriter | None:
        """The shared-memory writer (None with transport "socket")."""
        return next((s.writer for s in self._senders if isinstance(s, ShmSender)), None)

    def _send(self, parts: list) -> None:
        self._pub.send_multipart(parts, copy=False)

    def publish(self, adapter: Adapter) -> int:
        """Send `adapter` to every subscriber and keep it for `latest`; returns its size in bytes
        (the safetensors blob). ValueError for an adapter without tensors. Each chunk is hashed
        just before it is sent (ZeroMQ's I/O thread sends the last one meanwhile). Nothing is
        copied: tensors already in the wire dtype, contiguous and on the CPU are sent, and kept
        for `latest`, from their own memory, so the caller hands them over and must never change
        them afterwards (the learner publishes a snapshot); others travel as converted copies."""
        blob, chunk = layout(adapter, self.dtype, self.chunk_bytes, self.hwm // 2)  # two adapters fit a queue
        with self._lock:
            for sender in self._senders:
                sender.send(adapter, blob, chunk)
        return blob.size

    def _serve(self) -> None:
        announced = time.monotonic()
        nothing = wire.encode(Nothing(), self.key)
        while not self._stop.is_set():
            if time.monotonic() - announced > self.announce_s:
                announced = time.monotonic()
                with self._lock:
                    if self._socket.commit is not None:  # again: for subscribers that lost it, or every chunk
                        self._send([NEWS, self._socket.commit])
            if not self._router.poll(100):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 2:
                continue
            try:
                wire.decode(frames[1], self.key, (Latest,))
            except WireError:
                continue  # unsigned or garbage: no adapter for strangers
            latest = self._socket.latest  # one read: `publish` may swap it meanwhile
            self._router.send_multipart([frames[0], *(latest or [nothing])], copy=False)

    def close(self) -> None:
        """Stop answering `latest` and close the sockets."""
        self._stop.set()
        self._thread.join(5)
        self._router.close(0)
        self._pub.close(0)
        for sender in self._senders:
            sender.close()
