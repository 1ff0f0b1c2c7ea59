"""The replay service: a ReplayBuffer behind one ZeroMQ ROUTER socket.

Requests and replies are wire frames (replay/wire.py). A request that cannot be
answered yet — a credit while capacity is exhausted, a batch while too few
fresh groups are stored — is parked and answered as soon as the state allows,
so clients block on their own socket instead of polling. A malformed frame gets
an error reply and a count; the server keeps serving everyone else.

Run standalone: `python -m replay.server --groups-per-step 16 --bind tcp://127.0.0.1:5555`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import zmq

from replay.buffer import ReplayBuffer
from replay.wire import Group, WireError, pack, unpack

REQUESTS = ("hello", "credit", "push", "sample", "stats")


@dataclass
class ReplayConfig:
    """The replay service (data plane)."""

    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default; set a routable address to serve other machines."""
    port: int = 0
    """TCP port (0 picks a free one)."""
    capacity: int = 1024
    """Most groups stored or in flight at once; when full, actors wait for credits."""

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"--replay.capacity must be at least 1, got {self.capacity}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--replay.port must be in [0, 65535], got {self.port}")


class ReplayServer:
    """Serve `buffer` on `bind` until `stop()`.

    Usage::

        server = ReplayServer(ReplayBuffer(16, max_staleness=2), "tcp://127.0.0.1:*")
        endpoint = server.start()          # a background thread serves from here on
        ...
        server.stop()
    """

    def __init__(self, buffer: ReplayBuffer, bind: str) -> None:
        self.buffer = buffer
        self.bind = bind
        self.endpoint = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._credit_waiters: list[tuple[bytes, int, str, float]] = []  # (peer, request id, actor, since)
        self._sample_waiters: list[tuple[bytes, int, int, int]] = []    # (peer, request id, step, rank)
        self.credit_wait_s = 0.0
        self.lock = threading.Lock()  # guards buffer snapshots read from other threads

    def start(self) -> str:
        self._thread = threading.Thread(target=self._serve, name="replay-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self.endpoint

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def snapshot(self) -> dict:
        with self.lock:
            return {**self.buffer.snapshot(), "credit_wait_s": self.credit_wait_s,
                    "credit_waiters": len(self._credit_waiters)}

    # -- the loop -----------------------------------------------------------
    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            sock.bind(self.bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            sock.close()
            ctx.term()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart(copy=True)
                with self.lock:
                    self._handle(sock, frames)
                    self._wake(sock)
        finally:
            sock.close(0)
            ctx.term()

    def _reply(self, sock, peer: bytes, rid: int, msg_type: str, **fields) -> None:
        sock.send_multipart([peer, pack(msg_type, id=rid, **fields)])

    def _handle(self, sock, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.buffer.stats.malformed_frames += 1
            if len(frames) >= 1:
                self._reply(sock, frames[0], -1, "error", reason="expected exactly one frame per request")
            return
        peer, frame = frames
        rid = -1
        try:
            msg = unpack(frame, REQUESTS)
            rid = msg.get("id", -1)
            if not isinstance(rid, int):
                raise WireError("request id must be an integer")
            self._dispatch(sock, peer, rid, msg, len(frame))
        except WireError as exc:
            self.buffer.stats.malformed_frames += 1
            self._reply(sock, peer, rid if isinstance(rid, int) else -1, "error", reason=str(exc))
        except ValueError as exc:  # well-formed but refused (bad rank, shard taken twice, ...)
            self._reply(sock, peer, rid, "error", reason=str(exc))

    def _dispatch(self, sock, peer: bytes, rid: int, msg: dict, nbytes: int) -> None:
        kind = msg["type"]
        if kind == "hello":
            self.buffer.hello(_str(msg, "actor"))
            self._reply(sock, peer, rid, "ok")
        elif kind == "credit":
            self._credit_waiters.append((peer, rid, _str(msg, "actor"), time.monotonic()))
        elif kind == "push":
            group = Group.from_wire(msg.get("group"))
            status = self.buffer.push(group, nbytes)
            self._reply(sock, peer, rid, "ack", group_id=group.group_id, status=status)
        elif kind == "sample":
            step, rank, version = (_int(msg, k) for k in ("step", "rank", "version"))
            self.buffer.set_version(version)
            self._sample_waiters.append((peer, rid, step, rank))
        elif kind == "stats":
            self._reply(sock, peer, rid, "stats", stats={**self.buffer.snapshot(),
                                                          "credit_wait_s": self.credit_wait_s})

    def _wake(self, sock) -> None:
        """Answer parked requests that the new state allows."""
        still = []
        for peer, rid, step, rank in self._sample_waiters:
            try:
                shard = self.buffer.take(step, rank)
            except ValueError as exc:
                self._reply(sock, peer, rid, "error", reason=str(exc))
                continue
            if shard is None:
                still.append((peer, rid, step, rank))
            else:
                self._reply(sock, peer, rid, "batch", step=step, version=self.buffer.version,
                            groups=[g.to_wire() for g in shard])
        self._sample_waiters = still
        while self._credit_waiters:
            peer, rid, actor, since = self._credit_waiters[0]
            credit = self.buffer.grant(actor)
            if credit is None:
                break
            self._credit_waiters.pop(0)
            self.credit_wait_s += time.monotonic() - since
            self._reply(sock, peer, rid, "credit", version=credit.version)


def _str(msg: dict, key: str) -> str:
    val = msg.get(key)
    if not isinstance(val, str) or not 0 < len(val) <= 128:
        raise WireError(f"field {key!r} must be a string of 1 to 128 characters")
    return val


def _int(msg: dict, key: str) -> int:
    val = msg.get(key)
    if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val < 1 << 40:
        raise WireError(f"field {key!r} must be a non-negative integer")
    return val


def main() -> None:
    import tyro

    @dataclass
    class Args:
        """Run the Tandem replay service on its own."""

        groups_per_step: int = 16
        """Groups per learner step (B)."""
        max_staleness: int = 2
        """Staleness bound η in policy versions."""
        learners: int = 1
        """Learner ranks: each step's batch is cut into this many shards."""
        replay: ReplayConfig = ReplayConfig()

    args = tyro.cli(Args)
    buffer = ReplayBuffer(args.groups_per_step, args.max_staleness, args.learners, args.replay.capacity)
    server = ReplayServer(buffer, f"tcp://{args.replay.host}:{args.replay.port or '*'}")
    print(f"replay serving on {server.start()}", flush=True)
    try:
        while True:
            time.sleep(10)
            print(server.snapshot(), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
