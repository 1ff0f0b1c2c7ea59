"""The cache of built-in models: each entry built once, whole, however many runs start at once.

Entries live under `cache_dir()` ($TANDEM_CACHE, default ~/.cache/tandem), one
Hugging Face model directory each (`tiny-v1`, `maze-sft-v2`, ...); an entry is
there when its config.json is.

Design decisions:
- Build, then rename. A builder writes into a private temporary directory next
  to the entry (same filesystem, so the rename is atomic) and renames it into
  place: a reader sees the whole entry or none of it, and a builder killed
  halfway leaves only its temporary directory behind.
- One builder at a time. Builders of an entry take an exclusive `flock` on a
  lock file beside it and check for the entry again once they hold it, so a
  second run that starts while the first is building waits for it and uses its
  entry instead of building its own (the maze warm start takes minutes).
- No trust in the lock alone: where `flock` is not supported (some network
  filesystems) builders run side by side, and the rename settles it. Renaming a
  directory onto one that another builder just filled fails (ENOTEMPTY); the
  loser then keeps the winner's entry and removes its own.
- The lock file stays: removing it would let a third process lock a fresh file
  while a second still holds the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_dir() -> Path:
    """Where built-in checkpoints are cached ($TANDEM_CACHE, default ~/.cache/tandem)."""
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def is_built(path: str | os.PathLike) -> bool:
    """Whether `path` is a finished entry (a model directory with its config.json)."""
    return (Path(path) / "config.json").is_file()


def build_once(path: str | os.PathLike, build: Callable[[Path], object],
               log: Callable[[str], None] | None = None) -> Path:
    """The entry at `path`, built by `build(tmp)` if it is not there yet.

    `build` writes a complete model directory into the empty directory `tmp` it is
    given; it runs at most once at a time across processes that lock the same
    entry, and not at all when the entry is there. Safe when several processes
    ask for the same entry at once: all of them return the one entry.
    """
    final = Path(path)
    if is_built(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.with_name(f".{final.name}.lock"), final, log):
        if is_built(final):  # built by whoever held the lock before us
            return final
        if final.exists():
            raise RuntimeError(f"{final} is in the way of the cache: it is not a finished model directory "
                               "(no config.json). Remove it and run again.")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            if log:
                log(f"building {final} (once; cached afterwards)")
            build(tmp)
            if not is_built(tmp):
                raise RuntimeError(f"building {final.name} wrote no config.json")
            try:
                os.rename(tmp, final)
            except OSError:  # a builder that did not see our lock got there first: use its entry
                if not is_built(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return final


@contextlib.contextmanager
def _locked(lock: Path, final: Path, log: Callable[[str], None] | None) -> Iterator[None]:
    """Hold an exclusive flock on `lock` (waiting for another builder), or go on unlocked where
    the filesystem has no flock."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if log:
                log(f"waiting for another process that is building {final}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no flock here (ENOLCK, EINVAL, ...): the rename alone settles a race
            pass
        yield
    finally:
        os.close(fd)  # releases the lock
