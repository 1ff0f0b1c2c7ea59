"""What runs beside a sandboxed command: the memory watcher all sandboxes share, the output cap.

RLIMIT_AS is per process, so a budget over a sandbox's whole process tree needs a watcher: one
thread for every sandbox of the process sums resident memory by pid namespace (one scan of
/proc per tick, whatever the number of sandboxes) and kills a sandbox over its budget. Pages
shared between processes count once for each (an overestimate, on the safe side).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

NOBODY = 65534
"""Host uid (and gid) the sandbox runs as when Tandem runs as root."""
WORKDIR = "/workspace"
"""Where the episode's folder appears inside the sandbox (not /work: host paths there may be bound)."""
WATCH_S = 0.05
"""How often the watcher sums each sandbox's memory."""
_PAGE = os.sysconf("SC_PAGE_SIZE")
log = logging.getLogger("tandem.sandbox")


class Watcher:
    """One thread for every sandbox of the process: sums resident memory by pid namespace."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._watched: dict[int, tuple[int, Callable[[], None]]] = {}  # pid-namespace inode -> (budget bytes, kill)
        self._uid = NOBODY if os.geteuid() == 0 else os.geteuid()
        threading.Thread(target=self._loop, name="tandem-sandbox-watch", daemon=True).start()

    def watch(self, ns: int, budget: int, kill: Callable[[], None]) -> None:
        """Call `kill` whenever the processes of pid namespace `ns` hold more than `budget` bytes."""
        with self._lock:
            self._watched[ns] = (budget, kill)
            self._wake.notify()

    def forget(self, ns: int) -> None:
        with self._lock:
            self._watched.pop(ns, None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._watched:
                    self._wake.wait()
                watched = dict(self._watched)
            for ns, rss in self._usage(watched).items():
                budget, kill = watched[ns]
                if rss > budget:
                    try:
                        kill()
                    except Exception:  # one sandbox's failure must not end the watch over all the others
                        log.exception("sandbox watcher: killing pid namespace %d failed", ns)
            time.sleep(WATCH_S)

    def _usage(self, watched: dict) -> dict[int, int]:
        usage: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != self._uid:
                    continue
                ns = int(os.readlink(f"/proc/{entry.name}/ns/pid")[5:-1])  # "pid:[4026532178]"
                if ns in watched:
                    with open(f"/proc/{entry.name}/statm", "rb") as f:
                        usage[ns] = usage.get(ns, 0) + int(f.read().split()[1]) * _PAGE
            except (OSError, ValueError):  # the process ended while we looked
                continue
        return usage


def sandboxed_pids(root: str | os.PathLike | None = None) -> list[int]:
    """Host pids of processes running in sandboxes (in a pid namespace other than ours, as the
    sandbox's host uid): empty whenever no command is running. With `root`, only those whose work
    folder is in that sandbox root (other jobs on the machine run sandboxes of their own)."""
    uid, ours, pids = NOBODY if os.geteuid() == 0 else os.geteuid(), os.readlink("/proc/self/ns/pid"), []
    for entry in os.scandir("/proc"):
        try:
            if (entry.name.isdigit() and entry.stat().st_uid == uid
                    and os.readlink(f"/proc/{entry.name}/ns/pid") != ours
                    and (root is None or _in_root(int(entry.name), os.path.basename(os.path.abspath(root))))):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _in_root(pid: int, root_name: str) -> bool:
    """Whether the process's work folder (what is bound at WORKDIR, as its mount table names it:
    the path within its filesystem) is an episode folder in a sandbox root named `root_name`."""
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == WORKDIR:
                folder = fields[3].rstrip("/")
                return os.path.basename(os.path.dirname(folder)) == root_name and \
                    os.path.basename(folder).startswith("ep-")
    return False


@functools.lru_cache(maxsize=1)
def watcher() -> Watcher:
    return Watcher()


class Capped:
    """The first and last `limit // 2` bytes of a stream, and how many were dropped between."""

    def __init__(self, limit: int) -> None:
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_len = self.cut = 0

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail.append(chunk)
        self.tail_len += len(chunk)
        while self.tail_len - len(self.tail[0]) >= self.half:
            self.cut += len(self.tail[0])
            self.tail_len -= len(self.tail.popleft())

    def text(self) -> str:
        tail = b"".join(self.tail)
        extra = len(tail) - self.half
        if extra > 0:
            self.cut, self.tail, tail = self.cut + extra, deque([tail[extra:]]), tail[extra:]
        middle = f"\n[... {self.cut} bytes of output cut ...]\n".encode() if self.cut else b""
        return (bytes(self.head) + middle + tail).decode("utf-8", "replace")
