"""Building real groups for replay tests (data, not stand-ins for our parts)."""

import uuid

import numpy as np

from replay.wire import Group, Trajectory


def make_group(version: int = 0, size: int = 4, length: int = 40, rewards=None, seed: int = 0,
               actor: str = "actor-0") -> Group:
    rng = np.random.default_rng(seed)
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(size)]
    trajs = []
    for r in rewards:
        mask = (np.arange(length) % 4 == 3).astype(np.uint8)
        trajs.append(Trajectory(
            tokens=rng.integers(4, 100, length).astype(np.int32),
            logprobs=np.where(mask, -rng.random(length) * 3, 0).astype(np.float32),
            mask=mask, versions=np.full(length, version, np.int32),
            reward=float(r), turns=3, finish_reason="terminated"))
    return Group(uuid.uuid4().hex, f"seed={seed}", trajs, actor=actor)


def make_entry(**kwargs):
    """A group as the buffer stores it."""
    from replay.buffer import Entry
    from replay.wire import encode_group

    g = make_group(**kwargs)
    return Entry.of(g, encode_group(g))
