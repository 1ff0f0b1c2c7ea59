"""The weight channel: versioned LoRA adapters from learner rank 0 to actors.

An adapter is a header {version, base model id, adapter config} and its tensors as safetensors
bytes (never pickle), cut into chunks (16 MiB by default, never over the 64 MiB frame cap), so
that adapters of any LoRA size travel (an 8B model's r = 32 adapter is ~333 MB in fp32; the
defaults carry up to 2 GiB, see below, and refuse more with a ValueError). Each chunk's
header carries the version, the chunk's index, the chunk count, the total length and the keyed
BLAKE3 (a MAC under a key derived from the run's key) of the chunk's data, and is signed with the
run's key; after the last chunk a signed commit carries the adapter's digest (replay/chunks.py
has the format and why it is shaped so). The publisher hashes each chunk just before sending
it, so the first leaves while the rest are hashed. With `dtype`, the publisher casts floating
tensors for the wire (bf16 when the learner trains in bf16); without it, tensors travel as they are.
Subscribers on the publisher's host read each version from a shared-memory file instead, announced
before the chunks, and stop taking chunks (replay/shm_weights.py); every message on the PUB socket
starts with its topic (NEWS or DATA) so that they can.

The publisher binds a PUB socket (every subscriber gets each new version as it is published) and
a ROUTER socket that answers "latest" requests with the current adapter, all its chunks in one
multipart reply: a PUB socket drops messages to late joiners, so a new or restarted actor asks
for the current adapter when it starts. ZeroMQ's CONFLATE keeps one message, which breaks
multi-part streams, so the subscriber keeps the newest version itself: chunks of a newer version
discard an older partial one, and `poll` hashes only the newest version's chunks. After the
chunks, and then every `announce_s`, the publisher sends the newest version's commit (one small
signed frame on the same PUB socket, so it arrives after every chunk of that version that was not
dropped): a subscriber delivers an adapter once it has every chunk and the commit; one that lacks
chunks of the committed version then knows that they were dropped, even all of them, and asks for
`latest`; a partial version that gets no chunk (or no commit) for `stall_s` also counts as
dropped (a publisher that stopped mid-adapter).

High-water marks count messages (chunks), and libzmq fixes a bound socket's when it binds, before
any adapter is seen. So the publisher's `hwm` (64 chunks: 1 GiB at 16 MiB) stays put and the
chunks grow instead (up to the frame cap) for an adapter that would need more than hwm / 2 of
them: two adapters always fit one subscriber's queue, so one that keeps up loses nothing, while
one that stops reading holds at most `hwm` chunks of the publisher's memory, then loses chunks
(and asks for `latest` when it reads again), never unbounded old versions.

Nothing fails silently. A frame that is unsigned, wrongly signed or not our schema is a
stranger's or garbage: it is rejected and counted (`rejected`). An adapter from our own
publisher that does not arrive whole (a chunk dropped or corrupt, a commit that never comes,
digests that do not add up, bytes that are not safetensors) makes the subscriber ask for
`latest`, a bounded number of times with a timeout; if it still has no good adapter it raises
`AdapterUndeliverable`, which stops the actor and the run with a message that says which
version, why, and what to check.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import zmq

from replay import wire
from replay.arena import host_id
from replay.chunks import (CHUNK_BYTES, Assembly, BrokenAdapter, ShmNote, read_chunk, read_commit, read_news,
                           shm_note, split_messages, stream_messages)
from replay.shm_weights import ShmWriter, read_shm
from replay.tensorblob import write_safetensors
from replay.wire import WireError, advertised, pack, unpack

WIRE_DTYPES = (None, "bfloat16", "float16", "float32")
"""Choices for the publisher's `dtype` (None: as given)."""
NEWS, DATA = b"tandem.adapter.news", b"tandem.adapter.data"
"""Topics of the PUB socket (each message's first frame): commits and shared-memory announcements,
which every subscriber takes; chunks, which a subscriber on the publisher's host stops taking
once it reads adapters from shared memory."""


class AdapterUndeliverable(RuntimeError):
    """An adapter from our own publisher could not be delivered, even by asking for `latest`."""


@dataclass
class Adapter:
    """One version of the policy's LoRA adapter, as it travels from the learner to the actors."""

    version: int
    base_model: str
    config: dict[str, Any]
    tensors: dict  # name -> torch.Tensor (PEFT state-dict names)


def encode_adapter(adapter: Adapter, key: bytes | None = None, *, dtype: str | None = None,
                   chunk_bytes: int | None = None, max_chunks: int | None = None) -> list[list]:
    """The messages that carry `adapter`: its chunks ([signed header, data]), then its commit
    ([signed commit]); floating tensors cast to `dtype` (one of WIRE_DTYPES). Chunks of
    `chunk_bytes`, made larger (up to the frame cap) where the adapter would need more than
    `max_chunks`. ValueError for an adapter without tensors, or one that does not fit
    `max_chunks` frames."""
    return list(stream_adapter(adapter, key, dtype=dtype, chunk_bytes=chunk_bytes, max_chunks=max_chunks))


def stream_adapter(adapter: Adapter, key: bytes | None = None, *, dtype: str | None = None,
                   chunk_bytes: int | None = None, max_chunks: int | None = None) -> Iterator[list]:
    """`encode_adapter`'s messages, each chunk hashed when it is taken (the ValueErrors come at
    once, before the first). Tensors already in the wire dtype, contiguous and on the CPU are
    sent from their own memory: they must not change while the messages are in use."""
    blob, chunk = _layout(adapter, dtype, chunk_bytes, max_chunks)
    return stream_messages(blob, adapter.version, adapter.base_model, adapter.config, key, chunk)


def _layout(adapter: Adapter, dtype: str | None, chunk_bytes: int | None, max_chunks: int | None):
    """(the adapter's safetensors pieces, the chunk size), or the ValueErrors of `encode_adapter`."""
    import torch

    if dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {dtype!r}: choose one of {WIRE_DTYPES}")
    if not adapter.tensors:
        raise ValueError(f"adapter version {adapter.version} has no tensors: nothing to publish "
                         "(does the LoRA config target any module of the model?)")
    blob = write_safetensors(adapter.tensors, getattr(torch, dtype) if dtype else None)
    chunk = chunk_bytes or min(CHUNK_BYTES, wire.MAX_FRAME)
    if max_chunks:
        chunk = min(wire.MAX_FRAME, max(chunk, -(-blob.size // max_chunks)))
        if -(-blob.size // chunk) > max_chunks:
            raise ValueError(f"adapter version {adapter.version} ({blob.size} bytes) needs more than {max_chunks} "
                             f"chunks of the {wire.MAX_FRAME}-byte frame cap: raise the publisher's hwm")
    return blob, chunk


def decode_adapter(messages: list[list], key: bytes | None = None) -> Adapter:
    """The adapter carried by `messages` (from `encode_adapter`, in order: chunks, then the commit).
    WireError if they are not signed, schema-conforming chunks; BrokenAdapter (a WireError) if they
    are our publisher's but do not make a whole adapter."""
    asm, done = None, None
    for parts in messages:
        if len(parts) == 1:
            done = read_commit(parts[0], key)
            continue
        head, data = read_chunk(parts, key)
        if asm is None:
            asm = Assembly(head, key)
        elif head.version != asm.version:
            raise BrokenAdapter(asm.version, f"versions {asm.version} and {head.version} mixed in one adapter")
        asm.add(head, data)
    if asm is None:
        raise WireError("no adapter chunks")
    if done is not None:
        if done.version != asm.version:
            raise BrokenAdapter(asm.version, f"a commit of version {done.version} came with its chunks")
        asm.seal(done)
    base_model, config, tensors = asm.finish()
    return Adapter(asm.version, base_model, config, tensors)


class WeightSource(Protocol):
    """Where an actor gets adapters.

    Usage::

        adapter = weights.latest(timeout=30)      # at start: the current adapter, if any
        while running:
            if (adapter := weights.poll()) is not None:
                engine.load_adapter(adapter.version, adapter.tensors)
    """

    def poll(self) -> Adapter | None:
        """The newest adapter published since the last call, or None (never blocks)."""

    def wait(self, timeout: float) -> Adapter | None:
        """Like `poll`, but block up to `timeout` seconds for a newer adapter."""

    def latest(self, timeout: float) -> Adapter | None:
        """Ask the publisher for its current adapter (None if it has published none)."""


class WeightPublisher:
    """Learner rank 0's end. `publish` is called from one thread; a helper thread answers `latest`.

    Usage::

        publisher = WeightPublisher(host, key=run_key, dtype="bfloat16")
        endpoints = publisher.endpoints               # (pub, latest): what subscribers connect to
        publisher.publish(Adapter(version, base_model, lora_config, tensors))   # after each step
        publisher.close()

    `dtype` casts floating tensors for the wire (one of WIRE_DTYPES); `chunk_bytes` is the chunk
    size; `hwm` the chunks each subscriber's queue holds (fixed at bind); `announce_s` the period
    of the announcements of the newest version; `advertise` the address subscribers reach (for a
    `host` of "0.0.0.0", one of this node's addresses); `shm` writes each version to shared memory
    for subscribers on this host, `host_key` saying which host this is (default: the boot id)."""

    def __init__(self, host: str = "127.0.0.1", pub_port: int = 0, req_port: int = 0,
                 key: bytes | None = None, *, dtype: str | None = None, chunk_bytes: int = CHUNK_BYTES,
                 hwm: int = 64, announce_s: float = 1.0, advertise: str | None = None, shm: bool = True,
                 host_key: str | None = None) -> None:
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {dtype!r}: choose one of {WIRE_DTYPES}")
        if not 0 < chunk_bytes <= wire.MAX_FRAME:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be 1 to the frame cap ({wire.MAX_FRAME})")
        if hwm < 2:
            raise ValueError(f"hwm={hwm}: the publisher's queue must hold at least 2 chunks")
        self.key, self.dtype, self.chunk_bytes, self.hwm, self.announce_s = key, dtype, chunk_bytes, hwm, announce_s
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)  # libzmq fixes it when binding: never changed later
        self._pub.bind(f"tcp://{host}:{pub_port or '*'}")
        self._latest: list | None = None
        self._head: bytes | None = None
        self._lock = threading.Lock()  # the PUB socket: `publish` sends chunks, the helper thread announcements
        self._stop = threading.Event()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(f"tcp://{host}:{req_port or '*'}")
        self.endpoints = (advertised(self._pub.getsockopt_string(zmq.LAST_ENDPOINT), advertise),
                          advertised(self._router.getsockopt_string(zmq.LAST_ENDPOINT), advertise))
        self._shm = ShmWriter(host=host_key) if shm else None
        self._thread = threading.Thread(target=self._serve, name="weights-latest", daemon=True)
        self._thread.start()

    def publish(self, adapter: Adapter) -> int:
        """Send `adapter` to every subscriber and keep it for `latest`; returns its size in bytes
        (the safetensors blob). ValueError for an adapter without tensors. Each chunk is hashed
        just before it is sent (ZeroMQ's I/O thread sends the last one meanwhile). Nothing is
        copied: tensors already in the wire dtype, contiguous and on the CPU are sent, and kept
        for `latest`, from their own memory, so the caller hands them over and must never change
        them afterwards (the learner publishes a snapshot); others travel as converted copies."""
        blob, chunk = _layout(adapter, self.dtype, self.chunk_bytes, self.hwm // 2)  # two adapters fit a queue
        sent = []
        with self._lock:
            name = self._shm.write(blob) if self._shm is not None else None
            if name is not None:  # subscribers on this host take it from there, before any chunk
                note = ShmNote(adapter.version, name, blob.size, self._shm.host, adapter.base_model, adapter.config)
                self._pub.send_multipart([NEWS, shm_note(note, self.key)])
            for parts in stream_messages(blob, adapter.version, adapter.base_model, adapter.config, self.key, chunk):
                if len(parts) > 1:
                    self._pub.send_multipart([DATA, *parts], copy=False)
                    sent.append(parts)
                    continue
                # The commit: after every chunk, on the same pipes, so a subscriber that lacks
                # chunks of the committed version has lost them (and asks `latest`: set it first).
                self._latest = [frame for chunk in sent for frame in chunk] + parts
                self._head = parts[0]
                self._pub.send_multipart([NEWS, self._head])
        return blob.size

    def _serve(self) -> None:
        announced = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - announced > self.announce_s:
                announced = time.monotonic()
                with self._lock:
                    if self._head is not None:  # the commit again: for subscribers that lost it, or every chunk
                        self._pub.send_multipart([NEWS, self._head])
            if not self._router.poll(100):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 2:
                continue
            try:
                unpack(frames[1], ("latest",), key=self.key)
            except WireError:
                continue  # unsigned or garbage: no adapter for strangers
            latest = self._latest  # one read: `publish` may swap it meanwhile
            self._router.send_multipart([frames[0], *(latest or [pack("none", key=self.key)])], copy=False)

    def close(self) -> None:
        """Stop answering `latest` and close the sockets."""
        self._stop.set()
        self._thread.join(5)
        self._router.close(0)
        self._pub.close(0)
        if self._shm is not None:
            self._shm.close()


class WeightSubscriber:
    """An actor's end (also the evaluator's).

    Usage::

        weights = WeightSubscriber(endpoints, key=run_key)
        adapter = weights.latest(timeout=30)          # at start
        adapter = weights.poll() or adapter           # between turns; AdapterUndeliverable stops the run

    `retries` requests for `latest` (each waiting up to `timeout` s) are what it takes, after an
    adapter from our publisher fails to arrive whole, before `AdapterUndeliverable`; a partial
    adapter that gets no new chunk for `stall_s` s has lost its tail; `hwm` is the receive queue
    in chunks (a full queue holds the publisher back, then its own queue drops); `host_key` which
    host this is, as the publisher's is (adapters announced from the same host are read from
    shared memory)."""

    def __init__(self, endpoints: tuple[str, str] | list[str], key: bytes | None = None, *,
                 retries: int = 3, timeout: float = 30.0, stall_s: float = 10.0, hwm: int = 32,
                 host_key: str | None = None) -> None:
        self.key, self.retries, self.timeout, self.stall_s = key, retries, timeout, stall_s
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, NEWS)
        self._sub.setsockopt(zmq.SUBSCRIBE, DATA)
        self._sub.connect(endpoints[0])
        self._host = host_key or host_id()
        self.local = False
        """Whether adapters come from shared memory (this subscriber is on the publisher's host)."""
        self._endpoints = (endpoints[0], endpoints[1])
        self._asm: Assembly | None = None
        self.version = -1
        """The newest version delivered."""
        self.rejected = 0
        """Frames rejected as a stranger's or garbage (unsigned, wrongly signed, not our schema)."""

    def _deliver(self, adapter: Adapter) -> Adapter | None:
        if adapter.version <= self.version:
            return None
        self.version = adapter.version
        if self._asm is not None and self._asm.version <= adapter.version:
            self._asm = None
        return adapter

    def _receive(self) -> Adapter | None:
        """Drain the PUB socket into the newest version's assembly, hashing each chunk as it is
        taken (while ZeroMQ receives the next ones, and before it leaves the cache); that adapter
        once whole. Chunks of a version older than one already seen are never hashed. BrokenAdapter
        if the newest version cannot be rebuilt from what arrived."""
        commits, notes, broken, asm = {}, [], None, self._asm
        while True:
            try:
                topic, *parts = self._sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                if topic.bytes == NEWS and len(parts) == 1:
                    news = read_news(parts[0], self.key)
                    if isinstance(news, ShmNote):
                        notes.append(news)
                    else:
                        commits[news.version] = news
                    continue
                if topic.bytes != DATA:
                    raise WireError(f"a message on topic {topic.bytes[:40]!r} with {len(parts)} more frames")
                head, data = read_chunk(parts, self.key)
                if head.version <= max(self.version, asm.version - 1 if asm else -1, broken.version if broken else -1):
                    continue  # delivered, superseded, or already broken: never hashed
                if asm is None or asm.version < head.version:
                    asm = self._asm = Assembly(head, self.key)
                asm.add(head, data)
                asm.check()
            except BrokenAdapter as exc:
                broken = exc if broken is None or exc.version >= broken.version else broken
            except WireError:
                self.rejected += 1
        newest = max([*commits, -1, asm.version if asm else -1, broken.version if broken else -1])
        if notes and notes[-1].version > self.version and notes[-1].version >= newest:
            adapter = self._from_shm(notes[-1])
            if adapter is not None:
                return adapter
        if newest <= self.version:
            return None
        if self.local and (asm is None or asm.version < newest):
            return self.latest(self.timeout)  # not in shared memory (no room there?): over the socket
        if broken is not None and broken.version == newest:
            raise broken
        done = commits.get(newest)
        if asm is not None and asm.version == newest:
            asm.check()
            if done is not None:
                asm.seal(done)
            if asm.ready:
                base_model, config, tensors = asm.finish()
                return self._deliver(Adapter(newest, base_model, config, tensors))
        lost = f"chunks {asm.missing()} of {asm.count}" if asm is not None and asm.version == newest else "its chunks"
        if done is not None:  # commits follow every chunk of their version
            raise BrokenAdapter(newest, f"the publisher committed it, but {lost} were dropped on the way")
        if asm is not None and time.monotonic() - asm.updated > self.stall_s:
            lost = "its commit" if asm.complete else lost
            raise BrokenAdapter(newest, f"{lost} did not arrive within {self.stall_s:g} s of the last chunk")
        return None

    def _from_shm(self, note: ShmNote) -> Adapter | None:
        """The adapter `note` announces, from shared memory; None if this subscriber is not on
        the publisher's host (or the file is gone: then the chunks, or `latest`, bring it)."""
        if note.host != self._host:
            return None
        try:
            tensors = read_shm(note.name, note.size)
        except OSError:
            return None
        except ValueError as exc:
            raise BrokenAdapter(note.version, f"its shared-memory file cannot be read ({exc})") from None
        if not self.local:  # the chunks of later versions need not cross the socket to this host
            self.local = True
            self._sub.setsockopt(zmq.UNSUBSCRIBE, DATA)
        return self._deliver(Adapter(note.version, note.base_model, note.config, tensors))

    def poll(self) -> Adapter | None:
        """The newest adapter published since the last call, or None. Never blocks, except to ask
        for `latest` when an adapter did not arrive whole (AdapterUndeliverable if that fails)."""
        try:
            return self._receive()
        except BrokenAdapter as exc:
            self._asm = None
            return self._recover(exc)

    def wait(self, timeout: float) -> Adapter | None:
        """Block up to `timeout` seconds for a newer adapter (None if none came)."""
        deadline = time.monotonic() + timeout
        while True:
            adapter = self.poll()
            left = deadline - time.monotonic()
            if adapter is not None or left <= 0:
                return adapter
            if self._asm is not None:  # wake up in time to notice a stall
                left = min(left, max(0.01, self._asm.updated + self.stall_s - time.monotonic()))
            self._sub.poll(max(1, int(left * 1000)))

    def _fetch(self, timeout: float) -> tuple[str, Any]:
        """One "latest" request: ("ok", Adapter), ("none", None), or ("timeout" | "stranger" |
        "broken", what went wrong)."""
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self._endpoints[1])
            req.send(pack("latest", key=self.key))
            if not req.poll(int(timeout * 1000)):
                return "timeout", f"no answer to 'latest' within {timeout:g} s"
            parts = req.recv_multipart(copy=False)
        finally:
            req.close(0)
        try:
            if len(parts) == 1:
                unpack(parts[0].bytes, ("none",), key=self.key)
                return "none", None
            return "ok", decode_adapter(split_messages(parts, self.key), self.key)
        except BrokenAdapter as exc:
            return "broken", exc
        except WireError as exc:
            self.rejected += 1
            return "stranger", f"the 'latest' reply was rejected ({exc})"

    def latest(self, timeout: float) -> Adapter | None:
        """Ask the publisher for its current adapter: None if it has published none, if the answer
        is not newer than `version`, or if none came within `timeout` s (or came from a stranger).
        An adapter of ours that arrives broken is asked for again, up to `retries` times in all,
        then AdapterUndeliverable."""
        broken, reasons = None, []
        for attempt in range(1, self.retries + 1):
            status, got = self._fetch(timeout)
            if status == "ok":
                return self._deliver(got)
            if broken is None and status != "broken":
                return None  # nothing, or no answer: as before, not an error
            broken = got if status == "broken" else broken
            reasons.append(self._why(status, got))
            if status == "none":
                break
            time.sleep(min(1.0, 0.1 * 2 ** attempt))
        raise self._undeliverable(broken.version, reasons, attempt)

    def _recover(self, broken: BrokenAdapter) -> Adapter | None:
        """`broken` came from our publisher: ask for `latest` until an adapter at least as new
        arrives whole, `retries` times at most, then AdapterUndeliverable."""
        reasons = [broken.reason]
        for attempt in range(1, self.retries + 1):
            status, got = self._fetch(self.timeout)
            if status == "ok" and got.version >= broken.version:
                return self._deliver(got)
            reasons.append(self._why(status, got))
            time.sleep(min(1.0, 0.1 * 2 ** attempt))
        raise self._undeliverable(broken.version, reasons, self.retries)

    @staticmethod
    def _why(status: str, got) -> str:
        if status == "ok":
            return f"'latest' answered with the older version {got.version}"
        if status == "none":
            return "'latest' answered that nothing is published"
        return f"'latest' answered with it, but {got.reason}" if status == "broken" else got

    def _undeliverable(self, version: int, reasons: list[str], asked: int) -> AdapterUndeliverable:
        return AdapterUndeliverable(
            f"adapter version {version} from the weight publisher at {self._endpoints[0]} / {self._endpoints[1]} "
            f"could not be delivered (this subscriber has version {self.version}; it asked for 'latest' {asked} "
            f"times): {'; '.join(reasons)}. Check that the learner (rank 0) is alive and publishing, that "
            "only one learner publishes there, that every part runs the same Tandem version with the same run "
            "key, and that the network between them neither drops nor alters data.")

    def close(self) -> None:
        """Close the socket."""
        self._sub.close(0)
