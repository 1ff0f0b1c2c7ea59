"""Collating groups from replay into padded tensors (pure, no model)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner.losses import group_advantages
from replay.wire import Group


@dataclass
class Batch:
    tokens: torch.Tensor       # [B, T] int64, padded with pad_id
    attention: torch.Tensor    # [B, T] 1 on real tokens
    mask: torch.Tensor         # [B, T] 1 on trained (model) tokens
    behaviour: torch.Tensor    # [B, T] log μ
    advantages: torch.Tensor   # [B] (group estimators; zeros for ppo)
    rewards: torch.Tensor      # [B]
    staleness: torch.Tensor    # [B] learner version − trajectory version
    images: list | None = None
    """Each row's images (uint8 H×W×3, in the order of their tokens); None: no row has any."""


def collate(groups: list[Group], version: int, pad_id: int, normalize_std: bool = True,
            algo: str = "grpo") -> Batch:
    """Pad the groups' trajectories into one batch; for grpo and rloo, compute each
    trajectory's advantage within its group (ppo's come from the critic, later: zeros here)."""
    trajs = [t for g in groups for t in g.trajectories]
    width = max(len(t.tokens) for t in trajs)
    n = len(trajs)
    tokens = np.full((n, width), pad_id, dtype=np.int64)
    attention = np.zeros((n, width), dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.float32)
    behaviour = np.zeros((n, width), dtype=np.float32)
    for i, t in enumerate(trajs):
        k = len(t.tokens)
        tokens[i, :k], attention[i, :k] = t.tokens, 1
        mask[i, :k], behaviour[i, :k] = t.mask, t.logprobs
    # Groups may differ in size (a failed environment shortens none, but a user's actor may);
    # advantages are computed group by group.
    if algo == "ppo":
        advantages = torch.zeros(n)
    else:
        advantages = torch.cat([group_advantages(torch.tensor(g.rewards)[None], algo, normalize_std)[0]
                                for g in groups])
    return Batch(tokens=torch.from_numpy(tokens), attention=torch.from_numpy(attention),
                 mask=torch.from_numpy(mask), behaviour=torch.from_numpy(behaviour),
                 advantages=advantages.float(),
                 rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
                 staleness=torch.tensor([version - t.version for t in trajs], dtype=torch.float32),
                 images=[list(t.images) for t in trajs] if any(len(t.images) for t in trajs) else None)
