"""Same-host fast path of the weight channel: each adapter version in a shared-memory file.

On one machine (a laptop, or a GPU node whose actors sit beside learner rank 0) an adapter need
not cross a loopback TCP connection once per actor, copied into and out of the kernel each time:
an 8B model's r = 32 adapter is 175 MB in bf16, so six actors would move a gigabyte through the
socket for every version. Instead the publisher writes each version's safetensors bytes once
into a new file in /dev/shm and announces it (a signed `adapter_shm.v3` message naming the file,
its size and the host's boot id) before the chunks; a subscriber on the same host maps the file
privately (copy-on-write: the tensors are writable views, and the file never changes), decodes
it in place and stops taking chunks from the socket. Subscribers on other hosts, or in another
container (they cannot open the file), go on with the chunks as before.

Trust is that of the replay's arenas (replay/arena.py): the announcement is signed with the run
key; the file is created exclusively (O_EXCL, mode 0600) by the publisher, opened without
following links, and must be a regular file of our own user of exactly the announced size; its
bytes are then checked as safetensors. There is no network between the two ends, so the data
is not hashed again (across machines every chunk is: weights/chunks.py).

Files are named `tandem-weights-<pid>-<token>`. The publisher keeps the newest `keep` versions'
files and removes older ones (a subscriber that mapped one keeps its pages until it drops the
adapter), removes its own on close, and sweeps files of dead publishers at start. When a file
cannot be written (no /dev/shm, or not room for the adapter: a container's default /dev/shm is
64 MB) the publisher logs why once and every subscriber takes that version from the socket.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

from weights.format import from_safetensors

log = logging.getLogger("tandem.weights")

SHM_DIR = "/dev/shm"
NAME = re.compile(r"^tandem-weights-(\d{1,10})-[0-9a-f]{16}$")


def host_id() -> str | None:
    """This machine's boot id (same host, same boot), or None where there is none (as
    replay/arena.py's: the weight channel keeps its own copy so as to import no other part)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def sweep(directory: Path, name: re.Pattern = NAME) -> None:
    """Remove weight files left by processes of ours that died without removing them (as
    replay/arena.py's `sweep` does for arenas)."""
    for path in directory.glob("tandem-weights-*"):
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


class ShmWriter:
    """The publisher's end: `write` puts a blob in a new file and returns its name.

    Usage::

        shm = ShmWriter()
        name = shm.write(blob)      # write_safetensors' pieces; None when the file cannot be had
        shm.close()                 # removes the files still kept
    """

    def __init__(self, directory: str = SHM_DIR, keep: int = 2, host: str | None = None) -> None:
        self.dir, self.keep = Path(directory), keep
        self.host = host or host_id()
        """Which host this is, as announced: `host` (the launcher gives its Ray node: two Ray nodes
        on one machine are two hosts, as for the replay's arenas), else the machine's boot id."""
        self.files: list[Path] = []
        self.off: str | None = None
        """Why the fast path is off (None while it is on)."""
        if self.host is None or not self.dir.is_dir() or not os.access(self.dir, os.W_OK):
            self.off = f"{self.dir} is not a writable directory on a host with a boot id"
        else:
            sweep(self.dir, NAME)

    def write(self, blob) -> str | None:
        """A new file holding `blob` (a `_Pieces`); its name, or None if the fast path is off
        (then, the first time, a warning saying why)."""
        if self.off is not None:
            return None
        path = self.dir / f"tandem-weights-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                for view in blob.views(0, blob.size):
                    while len(view):
                        view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            self.off = f"writing {blob.size} bytes to {self.dir} failed ({exc})"
            log.warning("weight channel: adapters go to actors on this host over the socket from now on: %s",
                        self.off)
            return None
        self.files.append(path)
        while len(self.files) > self.keep:
            self.files.pop(0).unlink(missing_ok=True)
        return path.name

    def close(self) -> None:
        """Remove the files kept."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files = []


def read_shm(name: str, size: int, directory: str = SHM_DIR) -> dict:
    """The tensors of the adapter file `name` (announced with `size` bytes), as views of a private
    mapping of it (reading maps the file's pages; nothing is copied until written). OSError if it
    cannot be opened (another host or container, or already removed); ValueError if it is not
    ours or not safetensors."""
    if not NAME.match(name):
        raise ValueError(f"{name!r} is not a weight file's name")
    fd = os.open(Path(directory) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size:
            raise ValueError(f"{name} is not a regular file of ours of {size} bytes")
        # Private: a tensor written to gets its own copy of that page, and the file never changes.
        # (MAP_POPULATE would copy every page now: it write-faults private writable mappings.)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return from_safetensors([mapping])
