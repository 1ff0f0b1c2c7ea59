"""The replay service: a ReplayBuffer behind one ZeroMQ ROUTER socket.

Requests and replies are wire frames (replay/wire.py), signed with the run's
key when there is one. A request that cannot be answered yet — a credit while
capacity is exhausted, a batch while too few fresh groups are stored — is
parked and answered as soon as the state allows, so clients block on their own
socket instead of polling. Every reply carries the server's `epoch` (random per
process): a client that sees it change knows parked requests were lost with a
restart and asks again.

Bad input never takes the service down: a frame that is oversized, unsigned,
tampered with, not msgpack or off-schema gets an error reply (where a reply is
possible) and a count, and the server goes on serving everyone else. Replies go
out with ROUTER_MANDATORY, so a reply to a peer that is gone raises instead of
vanishing silently; data a learner did not receive stays assigned to its step
and is served again when it asks. With a log, a batch shard is served only once
its assignment is on the log, so a restarted replay gives each rank the same
shard again (replay/buffer.py says what is guaranteed).

Run standalone: `python -m replay.server --help`.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import zmq

from replay.arena import ARENA_DIR, ArenaReader, host_id
from replay.buffer import Entry, ReplayBuffer
from replay.checker import Checker
from replay.log import Fsync
from replay.log_writer import LogWriter
from replay.wake import drain
from replay.messages import Ack, Credit, Hello, Ping, Push, Request, Sample, Stats, decode_request
from replay.wire import MAX_FRAME, WireError, advertised, pack_parts


@dataclass
class ReplayConfig:
    """The replay service (data plane)."""

    host: str | None = None
    """Address the replay service, the weight publisher and the learners' rendezvous listen on: an
    address of this machine, "0.0.0.0" (every interface; each part advertises its node's address)
    or "node" (each part's node address, as Ray knows it). Default: loopback for a local run,
    "node" when joining a cluster with --ray-address. Frames stay signed (--replay.sign)."""
    port: int = 0
    """TCP port (0 picks a free one)."""
    capacity: int = 1024
    """Most groups stored or in flight at once; when full, actors wait for credits."""
    capacity_mb: int = 4096
    """Most megabytes of stored groups; when full, actors wait for credits."""
    order: Literal["fifo", "newest"] = "fifo"
    """Sampling order among fresh groups: "fifo" (oldest first) or "newest"."""
    drop_zero_variance: bool = False
    """Dynamic sampling (DAPO's): drop (and count) groups whose rewards are all equal (under
    --actor.turn-discount, the rewards before the discount), which carry no signal for
    group-relative advantages, so that every step trains on groups that do; a step then
    waits for more rollouts. It never starves the learner: after --replay.drop-patience steps'
    worth of such groups in a row (a task the policy always or never solves), they are kept until a
    group with a signal comes. For the asynchronous mode with --algo grpo or rloo (refused with PPO,
    whose critic learns from every group, and with --colocate). docs/vision.md and
    docs/experiments.md measure it."""
    drop_patience: int = 2
    """Equal-reward groups dropped in a row, in steps' worth (× groups per step), before they are kept."""
    log: bool = True
    """Keep the append-only log (stored groups survive a replay restart and a resume) in the run
    directory whenever checkpoints are on; --replay.no-log turns it off."""
    log_dir: str | None = None
    """Where the log goes instead of <run dir>/replay-log (on also without checkpoints)."""
    keep_log: bool = False
    """Keep every segment of the log, also those whose groups were all consumed (for an audit of
    the whole run: `replay.log.history`); by default consumed segments are removed."""
    fsync: Fsync = "interval"
    """When the log is fsynced: "always" (before every ack), "interval" (about once a second), "never"."""
    arena_mb: int = 64
    """Each actor's shared-memory arena (/dev/shm), reserved up front: on replay's host, groups
    travel through it by reference instead of on the socket. 0 sends every group on the socket."""
    lease_s: float = 600.0
    """Credits held by an actor that has not asked for a credit or pushed a group for this long go
    back to the pool (an actor that died and was not restarted holds none for ever)."""
    restarts: int = 3
    """Times the launcher restarts a replay process that died (on the same port; with the log, every
    stored group comes back); past that the run stops with a message."""
    sign: bool = True
    """Authenticate every frame with HMAC-SHA256 under a per-run key (the launcher makes and hands it out)."""

    def __post_init__(self) -> None:
        if self.restarts < 0:
            raise ValueError(f"--replay.restarts must be 0 or more, got {self.restarts}")
        if self.lease_s <= 0:
            raise ValueError(f"--replay.lease-s must be positive, got {self.lease_s}")
        if self.drop_patience < 1:
            raise ValueError(f"--replay.drop-patience must be at least 1, got {self.drop_patience}")
        if self.arena_mb < 0:
            raise ValueError(f"--replay.arena-mb must be 0 (off) or more, got {self.arena_mb}")
        if self.capacity < 1 or self.capacity_mb < 1:
            raise ValueError("--replay.capacity and --replay.capacity-mb must be at least 1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--replay.port must be in [0, 65535], got {self.port}")

    def make_buffer(self, groups_per_step: int, max_staleness: int, learners: int,
                    log_dir: str | None = None) -> ReplayBuffer:
        """The buffer, keeping its log in `log_dir` (default --replay.log-dir; None: no log)."""
        from replay.log import ReplayLog

        log_dir = log_dir or self.log_dir
        log = ReplayLog(log_dir, fsync=self.fsync, prune=not self.keep_log) if log_dir else None
        return ReplayBuffer(groups_per_step, max_staleness, learners, self.capacity, self.capacity_mb << 20,
                            self.order, self.drop_zero_variance, log, lease_s=self.lease_s,
                            drop_patience=self.drop_patience)

    def bind(self, address: str | None = None) -> str:
        """The endpoint to bind: on `address` (resolved by the launcher), else on --replay.host or loopback."""
        return f"tcp://{address or self.host or '127.0.0.1'}:{self.port or '*'}"


class ReplayServer:
    """Serve `buffer` on `bind` until `stop()`.

    Usage::

        server = ReplayServer(ReplayBuffer(16, max_staleness=2), "tcp://127.0.0.1:*", key=key)
        endpoint = server.start()          # a background thread serves from here on
        ...
        server.stop()
    """

    def __init__(self, buffer: ReplayBuffer, bind: str, key: bytes | None = None,
                 arena_dir: str = ARENA_DIR, *, advertise: str | None = None, host: str | None = None) -> None:
        self.buffer, self.bind, self.key, self.advertise = buffer, bind, key, advertise
        self.epoch = secrets.token_hex(8)
        self.endpoint = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._credit_waiters: list[list] = []  # [peer, request id, actor, since, credits still wanted]
        self._sample_waiters: list[tuple[bytes, int, int, int, bool]] = []  # (peer, id, step, rank, same host)
        self.arenas = ArenaReader(arena_dir)  # actors' shared-memory arenas on this host
        self.host = host or host_id()
        """Which host this is: actors and learners that say the same one share memory with it."""
        self.credit_wait_s = 0.0
        self.lost_replies = 0
        self.lock = threading.Lock()  # guards the buffer against snapshot() from other threads
        self._writer: LogWriter | None = None  # writes the log on its own threads (replay/log_writer.py)
        self._writing: dict[str, list[tuple[bytes, int]]] = {}  # group on its way to the log -> resends
        self._acks: dict[bytes, list[tuple]] = {}  # peer -> (request id, status, group id) of pushes just logged

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
        if self.buffer.log is not None:
            try:
                self.buffer.log.close()
            except OSError as exc:  # the log failed already (and said so): nothing more to save
                logging.getLogger("tandem.replay").warning("closing the replay log: %s", exc)

    def wait(self) -> None:
        """Block until the service stops; RuntimeError with the error it stopped on, if any."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(1.0)
        if self._error is not None:
            raise RuntimeError(f"the replay service stopped: {self._error}") from self._error

    def snapshot(self) -> dict:
        """The counters; raises if the service has stopped on an error (a log it cannot write)."""
        if self._error is not None:
            raise RuntimeError(f"the replay service stopped: {self._error}") from self._error
        with self.lock:
            return {**self.buffer.snapshot(), "credit_wait_s": self.credit_wait_s,
                    "credit_waiters": len(self._credit_waiters), "lost_replies": self.lost_replies}

    # -- the loop -----------------------------------------------------------
    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME + 1024)  # oversized frames are cut off by ZeroMQ itself
        try:
            sock.bind(self.bind)
            self.endpoint = advertised(sock.getsockopt_string(zmq.LAST_ENDPOINT), self.advertise)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            sock.close()
            ctx.term()
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        self._checker = Checker(ctx, checksums=self.buffer.log is not None)
        checked = self._checker.waker.listen()
        poller.register(checked, zmq.POLLIN)
        log_done = None
        if self.buffer.log is not None:
            self._writer = LogWriter(self.buffer.log, ctx)
            self.buffer.log = self._writer
            log_done = self._writer.waker.listen()
            poller.register(log_done, zmq.POLLIN)
        self._ready.set()
        leases = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if time.monotonic() - leases > 1.0:
                    leases = time.monotonic()
                    with self.lock:
                        if self.buffer.expire():
                            self._wake(sock)  # room for the credit requests parked
                if checked in events:
                    drain(checked)
                    with self.lock:
                        for push, error, (peer, rid), blob_sum in self._checker.done():
                            self._checked(sock, push, error, peer, rid, blob_sum)
                        self._wake(sock)
                if log_done in events:
                    drain(log_done)
                    if self._writer.error is not None:
                        raise RuntimeError(f"replay log: {self._writer.error}") from self._writer.error
                    with self.lock:
                        for callback in self._writer.due():  # records on the log: acknowledge them
                            callback()
                        self._send_acks(sock)
                        self._wake(sock)
                if sock in events:
                    with self.lock:
                        for _ in range(64):  # what has arrived, then one look at parked requests
                            try:  # group blobs stay in ZeroMQ's buffers
                                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                            except zmq.Again:
                                break
                            self._handle(sock, frames)
                        self._wake(sock)
        except Exception as exc:  # noqa: BLE001 - kept, and raised by snapshot(), so the owner stops
            self._error = exc
            logging.getLogger("tandem.replay").error("the replay service stopped: %s", exc)
        finally:
            self._checker.close()
            checked.close(0)
            if self._writer is not None:
                self._writer.close()  # writes what is queued
                self.buffer.log = self._writer.log
                log_done.close(0)
            sock.close(0)
            ctx.term()

    def _reply(self, sock, peer: bytes, rid: int, msg_type: str, blobs: list = (), **fields) -> bool:
        try:
            parts = pack_parts(msg_type, blobs, key=self.key, id=rid, epoch=self.epoch, **fields)
            sock.send_multipart([peer, *parts], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:  # the peer is gone or not reading: drop the reply, never its data
            self.lost_replies += 1
            return False

    def _handle(self, sock, frames: list) -> None:
        peer, parts = frames[0].bytes, frames[1:]
        rid = -1
        try:
            msg, blobs = decode_request(parts, key=self.key)
            rid = msg.id
            self._dispatch(sock, peer, rid, msg, blobs)
        except WireError as exc:
            rid = getattr(exc, "id", rid)
            self.buffer.stats.malformed_frames += 1
            self._reply(sock, peer, rid, "error", reason=str(exc))
        except ValueError as exc:  # well-formed but refused (bad rank, ...)
            self._reply(sock, peer, rid, "error", reason=str(exc))

    def _dispatch(self, sock, peer: bytes, rid: int, msg: Request, blobs: list) -> None:
        match msg:
            case Hello(actor=actor, arena=name, token=token, host=host):
                self.buffer.hello(actor)
                arena, reason = None, None
                if name is not None and (self.host is None or host != self.host):
                    # Another host (another Ray node, even on this machine): its memory is not ours.
                    arena, reason = False, f"the actor is on host {host!r}, replay on {self.host!r}"
                elif name is not None:  # the actor offers its shared-memory arena: can we open it?
                    if token is None:
                        raise WireError("hello: an arena comes with its token")
                    try:
                        self.arenas.open(name, token)
                        arena = True
                    except WireError as exc:
                        arena, reason = False, str(exc)
                self._reply(sock, peer, rid, "ok", arena=arena, reason=reason)
            case Ping():
                self._reply(sock, peer, rid, "ok")
            case Credit(actor=actor, n=n):
                self._credit_waiters.append([peer, rid, actor, time.monotonic(), n])
            case Push():  # the group's header and values are read on the checker thread
                self._checker.put(self._read(msg, blobs), (peer, rid))
            case Sample(step=step, rank=rank, version=version, acked=acked, host=host):
                if rank >= self.buffer.shards:
                    raise ValueError(f"rank {rank} out of range for {self.buffer.shards} learner ranks")
                for acked_step, acked_rank in acked:  # acks the client has no answer to:
                    self.buffer.ack(acked_step, acked_rank)  # consumed, not released by this request
                self.buffer.set_version(version)
                same_host = self.host is not None and host == self.host
                self._sample_waiters.append((peer, rid, step, rank, same_host))
            case Ack(step=step, rank=rank):
                ids = self.buffer.ack(step, rank)
                if self._writer is not None:  # answered once the consumed marker is on the log
                    self._writer.after(functools.partial(self._reply, sock, peer, rid, "ok", consumed=len(ids)))
                else:
                    self._reply(sock, peer, rid, "ok", consumed=len(ids))
            case Stats():
                self._reply(sock, peer, rid, "stats", stats={**self.buffer.snapshot(),
                                                              "credit_wait_s": self.credit_wait_s})

    def _logged(self, peer: bytes, rid: int, entry: Entry) -> None:
        """A pushed group is on the log: store it; acknowledge it and any resends of it with
        the others that the same write put on the log (`_send_acks`)."""
        self.buffer.commit(entry, len(entry.rewards))
        gid = entry.group_id
        self._acks.setdefault(peer, []).append((rid, "stored", gid))
        for resend_peer, resend_rid in self._writing.pop(gid, []):
            self._acks.setdefault(resend_peer, []).append((resend_rid, "duplicate", gid))

    def _send_acks(self, sock) -> None:
        """One message per peer for the pushes that one log write stored: "ack" for one,
        "acks" with [[request id, status], ...] in order for several."""
        for peer, acks in self._acks.items():
            if len(acks) == 1:
                rid, status, gid = acks[0]
                self._reply(sock, peer, rid, "ack", group_id=gid, status=status)
            else:
                self._reply(sock, peer, -1, "acks", acks=[[rid, status] for rid, status, _ in acks])
        self._acks.clear()

    def _read(self, msg: Push, blobs: list) -> tuple:
        """(blob, arena reference, release) of a push: its bytes in the message, or a view of
        the extent that the reference names in the actor's arena (offsets checked)."""
        if msg.shm is None:
            if len(blobs) != 1:
                raise WireError("push carries exactly one group")
            return blobs[0], None, None
        if blobs:
            raise WireError("push carries a group or an arena reference, not both")
        ref = list(msg.shm)
        view, fresh = self.arenas.acquire(ref)
        release = functools.partial(self.arenas.release, ref[0], ref[1]) if fresh else None
        return view, list(ref), release

    def _checked(self, sock, push: tuple, error: WireError | None, peer: bytes, rid: int,
                 blob_sum: int | None = None) -> None:
        """The checker thread is done with a pushed group: refuse it, or store it (on the log,
        with the blob's checksum the checker took)."""
        group, blob, ref, release = push
        if error is not None:
            if release is not None:
                release()  # refused: the actor may reuse the extent
            self.buffer.stats.malformed_frames += 1
            self._reply(sock, peer, rid, "error", reason=str(error))
            return
        entry = Entry.of(group, blob, ref, release)
        gid = entry.group_id
        if self._writer is None:  # no log: stored (or not) at once
            self._reply(sock, peer, rid, "ack", group_id=gid, status=self.buffer.push(entry, len(entry.rewards)))
            return
        status = self.buffer.admit(entry)
        if status is None:  # acknowledged once it is on the log
            self._writing[gid] = []
            padded = self.arenas.view(entry.ref, padded=True) if entry.ref else None  # no copy
            self._writer.stored(gid, entry.blob, padded, blob_sum)
            self._writer.after(functools.partial(self._logged, peer, rid, entry))
        elif status == "duplicate" and gid in self._writing:
            self._writing[gid].append((peer, rid))  # a resend: acknowledged with the original
        else:
            self._reply(sock, peer, rid, "ack", group_id=gid, status=status)

    def _wake(self, sock) -> None:
        """Answer parked requests that the new state allows."""
        still = []
        for waiter in self._sample_waiters:
            peer, rid, step, rank, same_host = waiter
            try:
                shard = self.buffer.take(step, rank)
            except ValueError as exc:
                self._reply(sock, peer, rid, "error", reason=str(exc))
                continue
            if shard is None:
                still.append(waiter)
                continue
            # if this reply is lost, the shard stays assigned and is served again on request
            refs = [e.ref if same_host else None for e in shard]  # same host: by reference
            reply = functools.partial(self._reply, sock, peer, rid, "batch",
                                      [e.blob for e, r in zip(shard, refs) if r is None],
                                      step=step, version=self.buffer.version, refs=refs)
            if self._writer is not None:  # served once the assignment (and any release) is on the log
                self._writer.after(reply)
            else:
                reply()
        self._sample_waiters = still
        while self._credit_waiters:  # oldest request first; one reply grants what room allows
            waiter = self._credit_waiters[0]
            peer, rid, actor, since, wanted = waiter
            versions = []
            while len(versions) < wanted and (credit := self.buffer.grant(actor)) is not None:
                versions.append(credit.version)
            if not versions:
                break
            self.credit_wait_s += (time.monotonic() - since) * len(versions)
            waiter[4] -= len(versions)
            delivered = self._reply(sock, peer, rid, "credit", versions=versions)
            if not delivered:  # the peer is gone: give them back, forget its request
                self.buffer.in_flight[actor] -= len(versions)
            if not delivered or not waiter[4]:
                self._credit_waiters.pop(0)


def key_from_env() -> bytes | None:
    """The run key from $TANDEM_KEY (hex), for parts started by hand."""
    value = os.environ.get("TANDEM_KEY")
    return bytes.fromhex(value) if value else None


def main() -> None:
    import tyro

    @dataclass
    class Args:
        """Run the Tandem replay service on its own. Frames are signed with $TANDEM_KEY (hex) if set."""

        groups_per_step: int = 16
        """Groups per learner step (B)."""
        max_staleness: int = 4
        """Staleness bound η in policy versions."""
        learners: int = 1
        """Learner ranks: each step's batch is cut into this many shards."""
        replay: ReplayConfig = field(default_factory=ReplayConfig)

    args = tyro.cli(Args)
    if args.replay.host == "node":  # a Ray node's address: only the launcher knows it
        raise SystemExit('error: --replay.host node is for parts the launcher places on Ray; give this '
                         'machine\'s address, or 0.0.0.0 for every interface')
    buffer = args.replay.make_buffer(args.groups_per_step, args.max_staleness, args.learners)
    server = ReplayServer(buffer, args.replay.bind(), key=key_from_env())
    print(f"replay serving on {server.start()} ({len(buffer.queue)} groups recovered)", flush=True)
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
