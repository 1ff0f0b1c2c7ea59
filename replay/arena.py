"""Same-host fast path: group blobs in shared memory instead of on the socket.

On one machine (a laptop, or one node of a cluster) a group need not cross two
loopback TCP connections, copied into and out of the kernel four times. Each
actor owns an *arena*, a file in /dev/shm that it maps, writes its encoded
groups into, and names in its push (`[arena, offset, length]`) instead of
sending the bytes. Replay maps the arena read-write, validates the blob in
place, stores the reference and serves it to a learner on the same host by
reference too; the learner reads it in place (the extent stays held until the
learner acknowledges the step, and its collate copies what it trains on, as it
would from a socket frame). Everything else is
unchanged: the push is acknowledged, deduplicated, credited and logged exactly
as a push with the bytes in it (the durable log writes the bytes from the
arena).

Arena layout: a head (magic, a random token that proves to replay it opened
the file the actor meant, and a table of one 8-byte state word per page), then
extents, page-aligned and zero-padded to whole pages, so that replay's log can
write a blob straight from the arena with O_DIRECT (replay/log.py). The actor
sets an extent's state to HELD before it pushes; replay sets it back to FREE
when it is done with the group (consumed, dropped as stale, filtered, a
duplicate, or refused); the actor reuses FREE extents. If replay restarts, its
references died with it: the actor frees every extent except those of its
unacknowledged pushes, which it sends again.

The fast path falls back to bytes on the socket, losing nothing, whenever it
cannot be used: no /dev/shm, an arena that cannot be reserved (its pages are
allocated up front, so a full /dev/shm is an error here and never a SIGBUS
later), a group larger than the free room, a replay on another host or in
another container (it cannot open the arena; it says so and the actor sends
bytes), a learner that cannot open an arena (it asks for the bytes).

Replay opens only names of the arena pattern in its own directory, without
following links, owned by its own user; offsets, lengths and state are checked
before anything is read, and the blob is then validated like any other.
"""

from __future__ import annotations

import bisect
import collections
import mmap
import os
import re
import secrets
import stat
import struct
import weakref
from pathlib import Path

from replay.wire import MAX_FRAME, WireError

ARENA_DIR = "/dev/shm"
NAME = re.compile(r"^tandem-arena-(\d{1,10})-[0-9a-f]{16}$")
MAGIC = b"TARENA02"
PAGE = 4096
STATE = struct.Struct("<Q")
FREE, HELD = 0, 1
MAX_ARENA = 1 << 40
_TABLE = 64  # the state table starts here, after magic and token


def head_size(size: int) -> int:
    """Bytes before the first extent of an arena of `size` bytes: magic, token, state table."""
    return pages(_TABLE + STATE.size * (size // PAGE))


def pages(n: int) -> int:
    """`n` rounded up to whole pages."""
    return (n + PAGE - 1) // PAGE * PAGE


def state_at(off: int) -> int:
    """Where the state word of the extent at `off` lives."""
    return _TABLE + STATE.size * (off // PAGE)


def host_id() -> str | None:
    """This machine's boot id (same host, same boot), or None where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def sweep(directory: Path, name: re.Pattern = NAME) -> None:
    """Remove files of `name`'s pattern (arenas by default; its first group is the owner's pid)
    left by processes of ours that died without removing them."""
    for path in directory.glob("tandem-*"):
        match = name.match(path.name)
        if match is None:
            continue
        try:
            if path.lstat().st_uid != os.geteuid():
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except OSError:
            continue


class Arena:
    """An actor's arena: allocate an extent, write a blob into it, name it in the push.

    Usage::

        arena = Arena.create(64 << 20)             # None where shared memory cannot be had
        ext = arena.alloc(n)                       # (offset, writable view of n bytes) or None
        ...write the blob into ext[1], push [arena.name, ext[0], n]...
        arena.close()                              # unlinks the file
    """

    def __init__(self, path: Path, size: int, mapping: mmap.mmap) -> None:
        self.path, self.name, self.size, self._map = path, path.name, size, mapping
        self.token = bytes(mapping[len(MAGIC):len(MAGIC) + 16]).hex()
        self.head = head_size(size)
        self._starts: list[int] = []        # offsets of held extents, sorted
        self._sizes: dict[int, int] = {}    # offset -> bytes reserved
        self._cursor = self.head
        self._finalizer = weakref.finalize(self, path.unlink, missing_ok=True)

    @classmethod
    def create(cls, size: int, directory: str = ARENA_DIR) -> Arena | None:
        """A new arena of `size` bytes, its pages reserved now; None if that is not possible."""
        folder = Path(directory)
        size = size // PAGE * PAGE
        if size < head_size(size) + PAGE or not folder.is_dir() or not os.access(folder, os.W_OK):
            return None
        sweep(folder)
        path = folder / f"tandem-arena-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            return None
        os.close(fd)
        mapping[:_TABLE] = (MAGIC + secrets.token_bytes(16)).ljust(_TABLE, b"\0")
        return cls(path, size, mapping)

    def alloc(self, n: int, keep=set) -> tuple[int, memoryview] | None:
        """An extent for an `n`-byte blob, marked HELD: (offset, writable view), or None if full.
        Extents that replay has set FREE are taken back only when room runs out (a pass over
        every held extent), except those in `keep()` (of pushes not yet acknowledged)."""
        need = pages(max(n, 1))
        if need > self.size - self.head:
            return None
        off = self._fit(need, self._cursor) or self._fit(need, self.head)
        if off is None:
            self._reclaim(keep())
            off = self._fit(need, self._cursor) or self._fit(need, self.head)
        if off is None:
            return None
        bisect.insort(self._starts, off)
        self._sizes[off] = need
        self._cursor = off + need
        self._map[off + n:off + need] = bytes(need - n)  # the padding goes to the log as is
        STATE.pack_into(self._map, state_at(off), HELD)
        return off, memoryview(self._map)[off:off + n]

    def _fit(self, need: int, start: int) -> int | None:
        """First gap of `need` bytes at or after `start` (next fit, like a ring)."""
        i = bisect.bisect_left(self._starts, start)
        if i and self._starts[i - 1] + self._sizes[self._starts[i - 1]] > start:
            start = self._starts[i - 1] + self._sizes[self._starts[i - 1]]
        for nxt in self._starts[i:] + [self.size]:
            if nxt - start >= need:
                return start
            if nxt < self.size:
                start = max(start, nxt + self._sizes[nxt])
        return None

    def _reclaim(self, keep=()) -> None:
        """Take back extents replay has set FREE (a late resend may still name those in `keep`)."""
        done = [off for off in self._starts
                if off not in keep and STATE.unpack_from(self._map, state_at(off))[0] == FREE]
        for off in done:
            self._forget(off)

    def _forget(self, off: int) -> None:
        self._starts.pop(bisect.bisect_left(self._starts, off))
        del self._sizes[off]

    def free(self, off: int) -> None:
        """Give an extent back without replay (it was never stored there)."""
        if off in self._sizes:
            STATE.pack_into(self._map, state_at(off), FREE)
            self._forget(off)

    def free_all_but(self, keep) -> None:
        """Replay restarted and forgot its references: free everything not in `keep`."""
        for off in [o for o in self._starts if o not in keep]:
            self.free(off)

    def view(self, off: int, n: int) -> memoryview:
        return memoryview(self._map)[off:off + n]

    def state(self, off: int) -> int:
        return STATE.unpack_from(self._map, state_at(off))[0]

    @property
    def held(self) -> int:
        """Extents replay holds now."""
        return sum(self.state(off) == HELD for off in self._starts)

    def close(self) -> None:
        self._finalizer()  # unlinks; the mapping goes when the last view of it does


class ArenaReader:
    """Replay's and a learner's side: open actors' arenas by name and read extents."""

    def __init__(self, directory: str = ARENA_DIR) -> None:
        self.dir = Path(directory)
        self._maps: dict[str, mmap.mmap] = {}
        self._held: set[tuple[str, int]] = set()
        self._count: collections.Counter = collections.Counter()  # arena -> extents held here

    def open(self, name: str, token: str | None = None) -> mmap.mmap:
        """Map arena `name` (WireError unless it is one of ours); check its token if given."""
        if not isinstance(name, str) or NAME.match(name) is None:
            raise WireError("arena: not an arena name")
        mapping = self._maps.get(name)
        if mapping is None:
            try:
                fd = os.open(self.dir / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise WireError(f"arena: cannot open {name}: {exc.strerror}") from None
            try:
                st = os.fstat(fd)
                if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size % PAGE
                        or not PAGE <= st.st_size <= MAX_ARENA):
                    raise WireError(f"arena: {name} is not an arena of this user")
                mapping = mmap.mmap(fd, st.st_size)
            finally:
                os.close(fd)
            if mapping[:len(MAGIC)] != MAGIC or len(mapping) < head_size(len(mapping)) + PAGE:
                raise WireError(f"arena: {name} is not an arena")
            self._maps[name] = mapping
        if token is not None and mapping[len(MAGIC):len(MAGIC) + 16].hex() != token:
            raise WireError(f"arena: {name} does not hold the token it was announced with")
        return mapping

    def extent(self, ref) -> tuple[str, int, int]:
        """Check the shape of a reference [name, offset, length]."""
        if not (isinstance(ref, (list, tuple)) and len(ref) == 3 and isinstance(ref[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in ref[1:])):
            raise WireError("arena: a reference is [name, offset, length]")
        name, off, n = ref
        if off % PAGE or not 0 < n <= MAX_FRAME:
            raise WireError("arena: offset or length out of range")
        return name, off, n

    def view(self, ref, padded: bool = False) -> memoryview:
        """A read-only view of the blob `ref` names, which must be marked HELD (with `padded`,
        to the end of its last page)."""
        name, off, n = self.extent(ref)
        mapping = self.open(name)
        if off < head_size(len(mapping)) or off + pages(n) > len(mapping):
            raise WireError("arena: extent out of the arena's range")
        if STATE.unpack_from(mapping, state_at(off))[0] != HELD:
            raise WireError("arena: extent is not marked held")
        return memoryview(mapping)[off:off + (pages(n) if padded else n)].toreadonly()

    def acquire(self, ref) -> tuple[memoryview, bool]:
        """(view, whether this reference is newly held here: only then does `release` free it)."""
        view = self.view(ref)
        key = (ref[0], ref[1])
        fresh = key not in self._held
        if fresh:
            self._held.add(key)
            self._count[ref[0]] += 1
        return view, fresh

    def release(self, name: str, off: int) -> None:
        """Done with an extent: mark it FREE for its actor to reuse."""
        if (name, off) in self._held:
            self._held.discard((name, off))
            self._count[name] -= 1
        mapping = self._maps.get(name)
        if mapping is not None:
            STATE.pack_into(mapping, state_at(off), FREE)
            if not self._count[name]:
                self.forget_closed([name])

    def forget_closed(self, names=None) -> None:
        """Unmap arenas (of `names`, or all) whose actor has closed them and of which nothing is
        held here: an unlinked file's memory goes back only with its last mapping (or view)."""
        for name in list(self._maps if names is None else names):
            if not self._count[name] and not (self.dir / name).exists():
                self._maps.pop(name, None)
                self._count.pop(name, None)
