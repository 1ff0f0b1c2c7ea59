"""Collating groups from replay into padded tensors (pure, no model)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner.losses import group_advantages, step_advantages, turn_index
from replay.wire import Group


@dataclass
class Batch:
    tokens: torch.Tensor       # [B, T] int64, padded with pad_id
    attention: torch.Tensor    # [B, T] 1 on real tokens
    mask: torch.Tensor         # [B, T] 1 on trained (model) tokens
    behaviour: torch.Tensor    # [B, T] log μ
    advantages: torch.Tensor   # [B] (group estimators; zeros for ppo); [B, T] with step advantages
    rewards: torch.Tensor      # [B]
    staleness: torch.Tensor    # [B] learner version − trajectory version
    images: list | None = None
    """Each row's images (uint8 H×W×3, in the order of their tokens); None: no row has any."""
    step_share: float | None = None
    """With step advantages: the share of the batch's turns whose step advantage is not 0 (played
    from a state other turns of their group were played from, with another return)."""


def collate(groups: list[Group], version: int, pad_id: int, normalize_std: bool = True,
            algo: str = "grpo", step_weight: float = 0.0, step_gamma: float = 0.95) -> Batch:
    """Pad the groups' trajectories into one batch; for grpo and rloo, compute each
    trajectory's advantage within its group (ppo's come from the critic, later: zeros here).
    With `step_weight` ω > 0 (GiGPO), the advantages are per token: the trajectory's plus ω
    times its turn's step-level advantage (`with_steps`)."""
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
    step_share = None
    if step_weight > 0:
        advantages, step_share = with_steps(groups, advantages, mask, normalize_std, step_weight, step_gamma)
    return Batch(tokens=torch.from_numpy(tokens), attention=torch.from_numpy(attention),
                 mask=torch.from_numpy(mask), behaviour=torch.from_numpy(behaviour),
                 advantages=advantages.float(),
                 rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
                 staleness=torch.tensor([version - t.version for t in trajs], dtype=torch.float32),
                 images=[list(t.images) for t in trajs] if any(len(t.images) for t in trajs) else None,
                 step_share=step_share)


def with_steps(groups: list[Group], advantages: torch.Tensor, mask: np.ndarray, normalize_std: bool,
               weight: float, gamma: float) -> tuple[torch.Tensor, float]:
    """Per-token advantages [B, T]: each trajectory's episode-level advantage on its model
    tokens, plus `weight` times the step-level advantage (`step_advantages`) of the turn each
    token belongs to; and the share of the turns (of episodes not broken) whose step advantage
    is not 0. ValueError for a group that did not record its turns' states, or a
    trajectory whose replies do not match its turns: the run asked for step advantages and
    must not train without them."""
    out = torch.from_numpy(mask).double() * advantages.double()[:, None]
    row, turns, compared = 0, 0, 0
    for g in groups:
        trajs = g.trajectories
        if any(len(t.anchors) != t.turns for t in trajs):
            raise ValueError(f"--learner.step-weight: group {g.group_id} (actor {g.actor or '?'}) does not carry "
                             "each turn's state (an actor before turn states, or a producer of its own); "
                             "play it with Tandem's actors or run without --learner.step-weight")
        # A broken episode's turns say nothing of the states they were played from: left out.
        kept = [t.finish_reason != "env_error" for t in trajs]
        steps = step_advantages([t.anchors if k else [] for t, k in zip(trajs, kept)],
                                [t.turn_rewards if k else [] for t, k in zip(trajs, kept)], gamma, normalize_std)
        for t, a in zip(trajs, steps):
            turn = turn_index(t.mask)
            replies = int(turn.max()) + 1 if turn.size else 0
            if replies not in (0, t.turns):  # 0: a broken episode, whose mask is cleared
                raise ValueError(f"--learner.step-weight: a trajectory of group {g.group_id} has {replies} "
                                 f"replies for {t.turns} turns")
            on = turn >= 0
            out[row, :len(turn)][torch.from_numpy(on)] += weight * torch.from_numpy(a[turn[on]])
            if replies:
                turns, compared = turns + replies, compared + int(np.count_nonzero(a))
            row += 1
    return out, compared / max(turns, 1)
