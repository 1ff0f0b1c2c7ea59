"""Waking the replay server loop from its worker threads.

The server loop sleeps in one ZeroMQ poll over its ROUTER socket and one inproc
PAIR socket per worker thread (the checker, the log writer). A worker that has
finished something signals its `Waker`; the loop wakes at once, takes the
finished work from the worker (a thread-safe list or deque) and acts on it.
"""

from __future__ import annotations

import zmq


class Waker:
    """The worker's end of an inproc PAIR (bound here); `listen()` gives the loop's end."""

    def __init__(self, ctx: zmq.Context, name: str) -> None:
        self.ctx = ctx
        self.endpoint = f"inproc://{name}-{id(self):x}"
        self._sock = ctx.socket(zmq.PAIR)
        self._sock.bind(self.endpoint)

    def listen(self) -> zmq.Socket:
        """The loop's end: poll it, then `drain` it."""
        sock = self.ctx.socket(zmq.PAIR)
        sock.connect(self.endpoint)
        return sock

    def signal(self) -> None:
        """From the worker thread (the only one that uses this end)."""
        try:
            self._sock.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already waiting; it covers this one too

    def close(self) -> None:
        self._sock.close(0)


def drain(sock: zmq.Socket) -> None:
    """Read every wake-up waiting on the loop's end."""
    while sock.poll(0):
        sock.recv()
