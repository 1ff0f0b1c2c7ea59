"""Reading pushed groups off the replay server loop.

The loop only takes a push off the socket (its bytes, or a view of the actor's
arena extent it names) and hands it here. This thread reads the group's header
and lengths (`read_group`) and checks its arrays' values (`check_group`: a few
numpy passes over every byte, which let go of the GIL), so the loop goes on
answering other peers meanwhile, and a large group never stalls them. With a
log, it also takes the blob's log checksum (replay/log.py) right after those
passes, while the bytes are still in this core's cache, rather than on the
log's formatting thread, which would read them all from memory again.
"""

from __future__ import annotations

import collections
import queue
import threading

import zmq

from replay.log import checksum
from replay.wake import Waker
from replay.wire import WireError, check_group, read_group


class Checker:
    """A thread that reads and checks pushed groups, in the order they came. `put` takes a
    push (blob, arena reference, release); `done()` gives ((group or None, blob, reference,
    release), error or None, context, the blob's log checksum or None) for each, and `waker`
    (replay/wake.py) says there are some. `checksums`: take the log checksum of every group
    that passes."""

    def __init__(self, ctx: zmq.Context, checksums: bool = False) -> None:
        self.checksums = checksums
        self.waker = Waker(ctx, "replay-checker")
        # Bounded: when checking falls behind, the server loop waits here and stops reading its
        # socket, so ZeroMQ's own limits push back on the senders. Nothing queues without bound.
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._done: collections.deque = collections.deque()
        self._thread = threading.Thread(target=self._run, name="replay-checker", daemon=True)
        self._thread.start()

    def put(self, push: tuple, context) -> None:
        """Read and check `push` = (blob, reference, release) (waits while 64 are queued)."""
        self._queue.put((push, context), timeout=60)

    def done(self) -> list:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            (blob, ref, release), context = job
            group = error = blob_sum = None
            try:
                group = check_group(read_group(blob, trajectories=False))
                if self.checksums:
                    blob_sum = checksum(blob)
            except ValueError as exc:  # WireError, or numpy refusing what the header claims
                error = exc if isinstance(exc, WireError) else WireError(f"group: {exc}")
            self._done.append(((group, blob, ref, release), error, context, blob_sum))
            self.waker.signal()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)
        self.waker.close()
