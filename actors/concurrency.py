"""How many groups an actor plays at once, and on how many environment threads, when
--actor.groups-in-flight and --actor.env-threads are left at 0: the CPU's tuned values, or scaled
from the actor's GPUs. launch/scale.py sizes the batch to match; docs/models.md, "How many
sequences in flight", gives examples."""

from __future__ import annotations

import math

SEQUENCES_PER_GPU = 256
"""Episodes an actor keeps in flight per GPU when --actor.groups-in-flight is 0: vLLM's default
batch (max_num_seqs) on GPUs below 70 GiB, a quarter of its default on an H100/H200; an
episode waiting on its environment holds no slot, so a full GPU stays busy."""
CPU_GROUPS_IN_FLIGHT = 4
"""--actor.groups-in-flight on the CPU (and the least on a GPU)."""
CPU_ENV_THREADS, EPISODES_PER_THREAD, MAX_ENV_THREADS = 8, 4, 64
"""--actor.env-threads: 8 on the CPU (32 episodes: one thread per 4); on a GPU the same ratio, up to 64."""


def scaled_groups_in_flight(gpus: float, group_size: int) -> int:
    """Groups an actor with `gpus` GPUs plays at once by default: 4 on the CPU; on GPUs enough for
    SEQUENCES_PER_GPU·gpus episodes, at least 4."""
    if gpus <= 0:
        return CPU_GROUPS_IN_FLIGHT
    return max(CPU_GROUPS_IN_FLIGHT, math.ceil(SEQUENCES_PER_GPU * gpus / group_size - 1e-9))


def scaled_env_threads(gpus: float, episodes: int) -> int:
    """Environment threads of an actor playing `episodes` at once by default: 8 on the CPU; on
    GPUs one per EPISODES_PER_THREAD episodes, from 8 to MAX_ENV_THREADS."""
    if gpus <= 0:
        return CPU_ENV_THREADS
    return min(max(CPU_ENV_THREADS, math.ceil(episodes / EPISODES_PER_THREAD)), MAX_ENV_THREADS)
