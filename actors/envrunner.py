"""Environment calls off the generation path, each with a time limit.

Environments are user code: a tool may be slow, a step may hang or raise. The
actor runs every `reset` and `step` on a small pool of daemon worker threads, so
the calls of one turn run concurrently with each other, and it waits for them
only briefly: an episode whose call is still running sits out the next
generation and rejoins when its observation is ready, so one slow tool does not
stall the batch. A call that runs past its limit is abandoned: it is reported as
a `TimeoutError`, and a fresh worker takes the place of the stuck one (a thread
cannot be killed; being a daemon, it cannot keep the process alive either).

Usage::

    runner = EnvRunner(timeout_s=30.0, threads=8)
    runner.submit(key, env.step, text)
    for call in runner.collect(wait_s=0.05, need_all=True):
        call.key, call.result, call.error      # error: the exception, or TimeoutError
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any


class Call:
    __slots__ = ("key", "fn", "args", "deadline", "result", "error", "finished", "abandoned")

    def __init__(self, key: Hashable, fn: Callable, args: tuple) -> None:
        self.key, self.fn, self.args = key, fn, args
        self.deadline: float | None = None  # set when a worker starts it
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = self.abandoned = False


class EnvRunner:
    def __init__(self, timeout_s: float = 30.0, threads: int = 8) -> None:
        if timeout_s <= 0 or threads < 1:
            raise ValueError("an environment runner needs a positive time limit and at least one thread")
        self.timeout_s = timeout_s
        self._todo: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._pending: dict[Hashable, Call] = {}
        self._lock = threading.Lock()
        self._workers = 0
        self.abandoned = 0
        """Calls given up on (their threads may still be running)."""
        for _ in range(threads):
            self._spawn()

    def _spawn(self) -> None:
        self._workers += 1
        threading.Thread(target=self._work, name="tandem-env", daemon=True).start()

    def _work(self) -> None:
        while True:
            call = self._todo.get()
            if call is None:
                return
            with self._lock:
                call.deadline = time.monotonic() + self.timeout_s
            try:
                call.result = call.fn(*call.args)
            except BaseException as exc:  # user code: anything it raises is that episode's end
                call.error = exc
            with self._lock:
                call.finished = True
                if call.abandoned:
                    return  # a replacement worker has taken this one's place
            self._done.put(call)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, key: Hashable, fn: Callable, *args) -> None:
        """Run `fn(*args)` on a worker; its outcome comes back from `collect` under `key`."""
        if key in self._pending:
            raise ValueError(f"a call for {key!r} is already running")
        call = Call(key, fn, args)
        self._pending[key] = call
        self._todo.put(call)

    def collect(self, wait_s: float, need_all: bool = True) -> list[Call]:
        """Finished calls, and calls past their time limit (error = TimeoutError).

        Waits up to `wait_s` for every pending call (`need_all`) or for at least one;
        returns at once with what is ready when `wait_s` is 0."""
        out: list[Call] = []
        end = time.monotonic() + wait_s
        while self._pending:
            self._expire(out)
            try:
                while True:  # everything already finished
                    call = self._done.get_nowait()
                    if self._pending.pop(call.key, None) is call:
                        out.append(call)
            except queue.Empty:
                pass
            now = time.monotonic()
            if not self._pending or now >= end or (out and not need_all):
                break
            with self._lock:
                deadlines = [c.deadline for c in self._pending.values() if c.deadline is not None]
            wake = min([end, *deadlines])
            try:
                call = self._done.get(timeout=max(wake - now, 0.0) + 1e-3)
                if self._pending.pop(call.key, None) is call:
                    out.append(call)
            except queue.Empty:
                pass
        return out

    def _expire(self, out: list[Call]) -> None:
        now = time.monotonic()
        with self._lock:
            late = [c for c in self._pending.values()
                    if c.deadline is not None and now > c.deadline and not c.finished]
            for call in late:
                call.abandoned = True
        for call in late:
            del self._pending[call.key]
            call.error = TimeoutError(f"environment call took longer than {self.timeout_s:g} s")
            self.abandoned += 1
            self._spawn()
            out.append(call)

    def close(self) -> None:
        """Stop the idle workers (a stuck one ends with its call)."""
        for _ in range(self._workers):
            self._todo.put(None)
        self._workers = 0
