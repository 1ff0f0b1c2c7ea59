"""Where the vLLM engine writes each adapter version for vLLM to load from.

vLLM loads a LoRA adapter from a folder, so every version the weight channel delivers is
written once in PEFT format. tmpfs (/dev/shm) makes that a memory copy, but a container's
/dev/shm is 64 MB by default and an 8B model's r = 32 adapter is ~175 MB in bf16: a version
that does not fit (checked before writing, and a write that still runs out of room) goes to a
folder on disk instead, and the engine logs why once. The weight channel falls back the same
way (weights/shm.py).
"""

from __future__ import annotations

import errno
import logging
import shutil
import tempfile
from pathlib import Path

from policy.adapter import write_adapter

log = logging.getLogger("tandem.actors")

SHM_DIR = "/dev/shm"
SLACK = 1 << 20
"""Room left beyond the tensors' bytes: the adapter's config and version files, and the
safetensors header."""


def adapter_bytes(tensors: dict) -> int:
    """Bytes an adapter's tensors take in its safetensors file (without the header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterFiles:
    """Adapter folders in tmpfs when there is room, on disk otherwise.

    Usage::

        files = AdapterFiles()                  # a folder of its own under /dev/shm (if any)
        path = files.write(version, tensors, lora, model_path)
        files.remove(path)                      # once vLLM has dropped that version
        files.close()                           # removes every folder it made
    """

    def __init__(self, fast: str | None = SHM_DIR, slow: str | None = None) -> None:
        """`fast`: the tmpfs to write in (None or a missing folder: none); `slow`: where the
        folder on disk goes (the system's temporary folder by default), made when first needed."""
        self.fast = (Path(tempfile.mkdtemp(prefix="tandem-lora-", dir=fast))
                     if fast is not None and Path(fast).is_dir() else None)
        self._slow_parent, self.slow = slow, None
        self.fell_back: str | None = None
        """Why the last version went to disk, or None while every version fitted in tmpfs."""

    def write(self, version: int, tensors: dict, lora, model_path: str) -> Path:
        """Write adapter `version` in its own folder and return the folder."""
        need = adapter_bytes(tensors) + SLACK
        if self.fast is not None:
            free = shutil.disk_usage(self.fast).free
            if free >= need:
                path = self.fast / f"v{version}"
                try:
                    return write_adapter(path, tensors, lora, model_path, version)
                except OSError as exc:
                    shutil.rmtree(path, ignore_errors=True)
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    self._fall_back(version, f"writing it ran out of room ({exc.strerror})")
            else:
                self._fall_back(version, f"{need >> 20} MiB needed, {free >> 20} MiB free")
        elif self.fell_back is None:
            self.fell_back = "no tmpfs"
        if self.slow is None:
            self.slow = Path(tempfile.mkdtemp(prefix="tandem-lora-", dir=self._slow_parent))
        return write_adapter(self.slow / f"v{version}", tensors, lora, model_path, version)

    def _fall_back(self, version: int, why: str) -> None:
        if self.fell_back is None:
            log.warning("adapter v%d does not fit in %s (%s): adapters are written to disk instead (a "
                        "larger /dev/shm, e.g. docker --shm-size 2g, keeps them in memory)", version, self.fast, why)
        self.fell_back = why

    @staticmethod
    def remove(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        for folder in (self.fast, self.slow):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
