"""How the batch and the actors' concurrency scale with the GPUs given, when left at 0.

On the CPU the defaults are those the project was tuned with (128 sequences a step: 16 groups of 8,
or 8 of 16; 4 groups in flight per actor, 8 environment threads). With GPUs, the staleness bound is
what caps a node: replay admits at most about (η + 1)·B groups in flight (capacity = (η + v + 1)·B −
(accepted + in_flight)), so at B = 16 and η = 1 the whole node plays ~256 sequences however many
GPUs it has. Here each actor plays enough for its GPUs (`ActorConfig.concurrent_groups`: 256
sequences a GPU), and B grows until the bound admits them all. Colocated ranks play their whole
share of a step at once. A number given for any of them wins; docs/models.md ("How many sequences in
flight") gives examples.
"""

from __future__ import annotations

import dataclasses
import math

from actors.actor import ActorConfig
from actors.concurrency import CPU_GROUPS_IN_FLIGHT, SEQUENCES_PER_GPU, scaled_env_threads

CPU_SEQUENCES_PER_STEP = 128
"""Sequences a step on the CPU (and the least with GPUs): --learner.groups-per-step is this over
the group size, 16 groups of 8."""


def cpu_groups_per_step(group_size: int) -> int:
    """B on the CPU: CPU_SEQUENCES_PER_STEP sequences in groups of `group_size` (rounded up)."""
    return -(-CPU_SEQUENCES_PER_STEP // group_size)


def _multiple(n: int, k: int) -> int:
    return -(-n // k) * k


def groups_per_step(actors: int, actor: ActorConfig, learners: int, learner_gpus: float, eta: int,
                    colocate: bool) -> int:
    """B of a run whose --learner.groups-per-step is 0 (see there): 128 sequences on the CPU (16
    groups of 8); async with actors on GPUs, ceil(actors × in-flight / (η + 1)); colocated ranks
    on GPUs, 256·g sequences a rank; at least the CPU's and a multiple of `learners` whenever GPUs
    scale it."""
    least = cpu_groups_per_step(actor.group_size)
    if colocate:
        if learner_gpus <= 0:
            return least
        wanted = learners * math.ceil(SEQUENCES_PER_GPU * learner_gpus / actor.group_size - 1e-9)
    else:
        if actor.num_gpus <= 0:
            return least
        wanted = math.ceil(actors * actor.concurrent_groups / (eta + 1))
    return _multiple(max(wanted, least), learners)


def rank_actor(actor: ActorConfig, share: int, learner_gpus: float) -> ActorConfig:
    """The actor settings of a colocated rank that plays `share` groups a step: on the CPU those
    of an actor on the CPU (4 groups at once, 8 threads); on a GPU all `share` at once, with
    threads to match. Numbers given for --actor.groups-in-flight and --actor.env-threads win."""
    groups = actor.groups_in_flight or (share if learner_gpus > 0 else CPU_GROUPS_IN_FLIGHT)
    threads = actor.env_threads or scaled_env_threads(learner_gpus, groups * actor.group_size)
    return dataclasses.replace(actor, groups_in_flight=groups, env_threads=threads)
