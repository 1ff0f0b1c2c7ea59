"""The replay log written by threads of its own (`LogWriter`), off the server loop.

Formatting records, writing them and syncing them overlap with serving and with
each other; an acknowledgement still means "on the log", as with `ReplayLog`
(replay/log.py) written inline.
"""

from __future__ import annotations

import functools
import queue
import threading

import zmq

from replay.log import ReplayLog
from replay.wake import Waker


class LogWriter:
    """A ReplayLog written by two threads of its own, so that checksums, writes and fsyncs
    overlap with serving and with each other: one formats records and checksums them, the
    other writes and syncs them in order. Same `stored` / `assigned` / `released` / `consumed`
    calls as the log, which queue the record and return; `after(fn)` queues a callback that
    becomes due once everything queued before it is written and synced per the policy (one
    write, and one sync, for all the records found waiting: a group commit). The owner runs due
    callbacks with `due()`, on its own thread, when woken through `waker` (replay/wake.py).

    The replay server acknowledges a push and a learner's `ack`, and serves a batch shard, only
    from such a callback, so an acknowledgement still means "on the log", exactly as with the
    log written inline, and a shard reaches a learner only once its assignment is on the log.
    """

    def __init__(self, log: ReplayLog, ctx: zmq.Context) -> None:
        self.log = log
        self.error: OSError | None = None
        """Set when a write failed: nothing after it is written or acknowledged; the server stops."""
        self._queue: queue.Queue = queue.Queue(maxsize=256)  # bounded: the server loop waits for the disk
        self._io_queue: queue.Queue = queue.Queue(maxsize=8)  # bounded: formatting waits for the disk
        log.submit = self._io_queue.put
        self._due: list = []
        self._lock = threading.Lock()
        self.waker = Waker(ctx, "replay-log")  # the owner listens before the first record
        self._threads = [threading.Thread(target=self._format, name="replay-log", daemon=True),
                         threading.Thread(target=self._write, name="replay-log-io", daemon=True)]
        for t in self._threads:
            t.start()

    def recover(self):
        return self.log.recover()

    def restore(self):
        return self.log.restore()

    def stored(self, group_id: str, blob, padded=None, blob_sum: int | None = None) -> None:
        self._put(("g", group_id, blob, padded, blob_sum))

    def consumed(self, group_ids: list[str], shard: tuple[int, int] | None = None) -> None:
        self._put(("c", list(group_ids), shard))

    def assigned(self, step: int, shards: list[list[str]]) -> None:
        self._put(("a", step, shards))

    def released(self, step: int, rank: int) -> None:
        self._put(("r", step, rank))

    def after(self, fn) -> None:
        self._put(("f", fn, None))

    def _put(self, item) -> None:
        """Queue `item`, waiting while the queue is full; OSError once the log has failed."""
        while True:
            if self.error is not None:
                raise OSError(f"replay log: {self.error}")
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def due(self) -> list:
        """Callbacks whose records are on the log, in order."""
        with self._lock:
            out, self._due = self._due, []
        return out

    def _format(self) -> None:
        try:
            stop = False
            while not stop:
                items = [self._queue.get()]
                while True:  # everything waiting goes into one write and one sync
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                callbacks = []
                try:
                    for item in items:
                        if item is None:
                            stop = True
                        elif item[0] == "g":
                            self.log.stored(item[1], item[2], sync=False, padded=item[3], blob_sum=item[4])
                        elif item[0] == "c":
                            self.log.consumed(item[1], sync=False, shard=item[2])
                        elif item[0] == "a":
                            self.log.assigned(item[1], item[2], sync=False)
                        elif item[0] == "r":
                            self.log.released(item[1], item[2], sync=False)
                        else:
                            callbacks.append(item[1])
                    self.log.sync()
                    if stop:
                        self.log.close()
                except OSError as exc:
                    self.error = exc
                    self._io_queue.put(self.waker.signal)
                    return
                if callbacks:
                    self._io_queue.put(functools.partial(self._release, callbacks))
                if self.error is not None:  # a write failed on the I/O thread: stop here too
                    return
        finally:
            self._io_queue.put(None)

    def _write(self) -> None:
        while (action := self._io_queue.get()) is not None:
            if self.error is not None and action != self.waker.signal:
                continue  # after a failure nothing more is written or acknowledged
            try:
                action()
            except OSError as exc:
                self.error = exc
                self.waker.signal()

    def _release(self, callbacks: list) -> None:
        with self._lock:
            self._due += callbacks
        self.waker.signal()

    def close(self) -> None:
        while self._threads[0].is_alive():  # the formatting thread writes what is queued, then stops
            try:
                self._queue.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        for t in self._threads:
            t.join(30)
        self.log.submit = None  # the log is written inline again (closing it, say)
        self.waker.close()
