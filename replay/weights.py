"""The weight channel: versioned LoRA adapters from learner rank 0 to actors.

An adapter travels as one wire frame: a header {version, base model id, adapter
config} and the tensors as safetensors bytes (never pickle). The publisher
binds a PUB socket (every subscriber gets each new version as it is published)
and a ROUTER socket that answers "latest" requests: a PUB socket drops messages
to late joiners, so a new or restarted actor asks for the current adapter when
it starts. Subscribers keep only the newest version (CONFLATE): an actor that
fell behind skips straight to the newest weights. With the run's key, adapter
frames and "latest" requests are signed (HMAC-SHA256) and checked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from replay.wire import WireError, pack, unpack


@dataclass
class Adapter:
    version: int
    base_model: str
    config: dict[str, Any]
    tensors: dict  # name -> torch.Tensor (PEFT state-dict names)


def encode_adapter(adapter: Adapter, key: bytes | None = None) -> bytes:
    from safetensors.torch import save

    blob = save({k: v.detach().contiguous().cpu() for k, v in adapter.tensors.items()})
    return pack("adapter", key=key, version=adapter.version, base_model=adapter.base_model,
                config=adapter.config, tensors=blob)


def decode_adapter(frame: bytes, key: bytes | None = None) -> Adapter:
    from safetensors.torch import load

    msg = unpack(frame, ("adapter",), key=key)
    version, base, config, blob = (msg.get(k) for k in ("version", "base_model", "config", "tensors"))
    if not isinstance(version, int) or version < 0 or not isinstance(base, str) \
            or not isinstance(config, dict) or not isinstance(blob, bytes):
        raise WireError("adapter frame: bad header fields")
    try:
        tensors = load(blob)
    except Exception as exc:
        raise WireError(f"adapter frame: tensors are not safetensors ({exc})") from None
    return Adapter(version, base, config, tensors)


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

    def latest(self, timeout: float) -> Adapter | None:
        """Ask the publisher for its current adapter (None if it has published none)."""


class WeightPublisher:
    """Learner rank 0's end. `publish` is called from one thread; a helper thread answers `latest`."""

    def __init__(self, host: str = "127.0.0.1", pub_port: int = 0, req_port: int = 0,
                 key: bytes | None = None) -> None:
        self.key = key
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 4)  # old adapters are worthless; newest wins
        self._pub.bind(f"tcp://{host}:{pub_port or '*'}")
        self._latest: bytes | None = None
        self._stop = threading.Event()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(f"tcp://{host}:{req_port or '*'}")
        self.endpoints = (self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
                          self._router.getsockopt_string(zmq.LAST_ENDPOINT))
        self._thread = threading.Thread(target=self._serve, name="weights-latest", daemon=True)
        self._thread.start()

    def publish(self, adapter: Adapter) -> int:
        frame = encode_adapter(adapter, self.key)
        self._latest = frame
        self._pub.send(frame)
        return len(frame)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(100):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 2:
                continue
            try:
                unpack(frames[1], ("latest",), key=self.key)
            except WireError:
                continue  # unsigned or garbage: no adapter for strangers
            self._router.send_multipart([frames[0], self._latest or pack("none", key=self.key)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(0)
        self._pub.close(0)


class WeightSubscriber:
    """An actor's end (also the evaluator's)."""

    def __init__(self, endpoints: tuple[str, str] | list[str], key: bytes | None = None) -> None:
        self.key = key
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.CONFLATE, 1)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoints[0])
        self._req_endpoint = endpoints[1]
        self.version = -1
        self.rejected = 0

    def _accept(self, frame: bytes) -> Adapter | None:
        try:
            adapter = decode_adapter(frame, self.key)
        except WireError:
            self.rejected += 1
            return None
        if adapter.version <= self.version:
            return None
        self.version = adapter.version
        return adapter

    def poll(self) -> Adapter | None:
        newest = None
        while self._sub.poll(0):
            adapter = self._accept(self._sub.recv())
            newest = adapter or newest
        return newest

    def wait(self, timeout: float) -> Adapter | None:
        """Block up to `timeout` for a newer adapter on the PUB channel."""
        if self._sub.poll(int(timeout * 1000)):
            return self.poll()
        return None

    def latest(self, timeout: float) -> Adapter | None:
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self._req_endpoint)
            req.send(pack("latest", key=self.key))
            if not req.poll(int(timeout * 1000)):
                return None
            frame = req.recv()
        finally:
            req.close(0)
        try:
            if unpack(frame, key=self.key).get("type") == "none":
                return None
        except WireError:
            self.rejected += 1
            return None
        return self._accept(frame)

    def close(self) -> None:
        self._sub.close(0)
