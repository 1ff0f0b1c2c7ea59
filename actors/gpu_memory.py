"""How much of a GPU a vLLM engine may take, and the checks that say so before vLLM fails.

vLLM sizes an engine by `gpu_memory_utilization` (--actor.memory-fraction): at start it
requires `fraction × total` bytes free and then fills them with weights, activations and its KV
cache (vllm/v1/worker/utils.py `request_memory`). Three things lie outside that budget and are
counted here:

- **Each process's CUDA context** (and cuBLAS/NCCL workspaces): created before vLLM takes its
  snapshot, so an engine uses `fraction × total + CONTEXT_BYTES`. Engines sharing a GPU with
  `--actor.gpus` g each therefore need `fraction ≤ g − CONTEXT_BYTES / total`
  (`largest_shared_fraction`).
- **A colocated learner.** vLLM's sleep (level 1) releases the engine's memory and `wake_up`
  re-creates every allocation at its original size (vllm/device_allocator/cumem.py), while the
  learner's caching allocator keeps its step's peak unless `torch.cuda.empty_cache()` returns
  it. The rank empties the cache before each wake and checks that what the engine released at
  its sleep fits in what is free (`check_wake`); at start the fraction must fit beside what the
  learner holds (`largest_fraction`).
- **Other engines starting at the same time**: vLLM profiles free memory over the whole device
  and assumes no other process changes its use meanwhile (its NOTE in gpu_worker.py), so engines
  sharing a GPU start one after another (`one_at_a_time`, a lock file per GPU).

Sizes are bytes; the arithmetic is pure so that it is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import tempfile

GIB = 1 << 30
CONTEXT_BYTES = GIB
"""Allowance for one process's CUDA context and library workspaces, outside vLLM's budget
(about 0.5 GiB on an H100 with CUDA 12; 1 GiB leaves room for cuBLAS and NCCL)."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _floor2(x: float) -> float:
    """Round a fraction down to two decimals (what a user types), never up."""
    return math.floor(x * 100 + 1e-9) / 100


def largest_shared_fraction(share: float, total: int, context: int = CONTEXT_BYTES) -> float:
    """The largest --actor.memory-fraction of an engine given `share` of a GPU of `total` bytes
    (--actor.gpus), its own CUDA context counted: `share − context / total`, two decimals."""
    return _floor2(share - context / total)


def check_shared_fraction(fraction: float, share: float, total: int, context: int = CONTEXT_BYTES) -> None:
    """ValueError when an engine given `share` of the GPU asks for more than its share once its CUDA
    context is counted (the next engine on the GPU would fail to start or to allocate its KV cache)."""
    if share >= 1:
        return
    if fraction * total + context > share * total:
        raise ValueError(
            f"--actor.memory-fraction {fraction:g} with --actor.gpus {share:g} on a GPU of {gib(total)}: each "
            f"engine takes {fraction:g} of the GPU plus its CUDA context (~{gib(context)}), more than its share; "
            f"set --actor.memory-fraction {largest_shared_fraction(share, total, context):g} or less "
            "(or --actor.kv-cache-gb)")


def largest_fraction(free: int, total: int, context: int = CONTEXT_BYTES) -> float:
    """The largest --actor.memory-fraction an engine can start with when `free` of `total` bytes
    are free before its process exists (a colocated learner holds the rest): its context comes
    out of `free` first. Zero or less: no engine fits."""
    return _floor2((free - context) / total)


def check_start_beside(fraction: float, free: int, total: int, held: int, context: int = CONTEXT_BYTES) -> None:
    """ValueError when a colocated engine of `fraction` cannot start beside a learner rank that
    holds `held` bytes (with `free` of `total` free after emptying its cache)."""
    largest = largest_fraction(free, total, context)
    if fraction <= largest:
        return
    fix = (f"set --actor.memory-fraction {largest:g} or less, or size the KV cache with --actor.kv-cache-gb"
           if largest > 0 else "the learner leaves no room for an engine: use more --learners (smaller shards) "
           "or run without --colocate")
    raise ValueError(
        f"--actor.memory-fraction {fraction:g} beside the learner rank: the GPU has {gib(total)}, the rank "
        f"holds {gib(held)} and {gib(free)} are free, of which the engine's CUDA context takes ~{gib(context)}; "
        f"{fix}")


def check_room_beside(fraction: float, device) -> None:
    """Before a vLLM engine starts on the GPU `device` where this process already holds a model (a
    colocated learner rank, the Tinker service's rank 0): return the caching allocator's unused
    blocks (vLLM requires its whole fraction free) and `check_start_beside` what is left."""
    import torch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    check_start_beside(fraction, free, total, torch.cuda.memory_reserved(device))


def check_wake(free: int, needed: int, held: int, total: int, fraction: float) -> None:
    """RuntimeError when a sleeping engine that released `needed` bytes at its sleep cannot take
    them back: `free` bytes are free after the learner emptied its cache and still holds `held`."""
    if needed <= free:
        return
    short = needed - free
    smaller = _floor2(fraction - short / total - 0.01)
    raise RuntimeError(
        f"the colocated vLLM engine needs {gib(needed)} to wake, but {gib(free)} of the GPU's {gib(total)} "
        f"are free while the learner rank holds {gib(held)} after its step: lower --actor.memory-fraction "
        f"to {max(smaller, 0):g} or less (or set --actor.kv-cache-gb), or use more --learners")


KEEP_MARGIN = 0.05
"""Share of the GPU left free when a colocated engine stays awake beside the learner's step
(allocator fragmentation, a longer batch than the one measured)."""


def fits_awake(awake: int, peak: int, held: int, free: int, total: int, margin: float = KEEP_MARGIN) -> bool:
    """Whether a colocated engine that holds `awake` bytes when awake can stay awake while the
    learner trains (--actor.sleep auto): measured with the engine asleep and the learner's cache
    emptied, the rank holds `held` bytes and `free` are free, and its last step peaked at `peak`
    reserved bytes; the engine, the step's growth (peak − held) and `margin`·total must fit in `free`."""
    return awake + max(peak - held, 0) + margin * total <= free


def lock_path(visible: str | None, folder: str | None = None) -> str | None:
    """The lock file of the GPU a process sees first (CUDA_VISIBLE_DEVICES, an index or a UUID,
    as Ray sets it per part), shared by every process on the host; None when it is not set."""
    if not visible or not visible.split(",")[0].strip():
        return None
    first = visible.split(",")[0].strip()
    if not all(c.isalnum() or c in "-_" for c in first):
        raise ValueError(f"CUDA_VISIBLE_DEVICES names a device as {first!r}: expected an index or a UUID")
    return os.path.join(folder or tempfile.gettempdir(), f"tandem-gpu-{first}.lock")


@contextlib.contextmanager
def one_at_a_time(path: str | None):
    """Hold the GPU's lock file while an engine starts, so that engines sharing a GPU profile its
    memory one after another. The kernel drops the lock if the process dies."""
    if path is None:
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
