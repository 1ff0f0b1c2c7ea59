"""Advantages and policy losses: pure functions, tensors in, (loss, metrics) out.

Shapes: B trajectories, T tokens (padded), G trajectories per group.

GRPO (Shao et al. 2024, DeepSeekMath): the advantage of trajectory i in a group
is its reward minus the group mean, divided by the group std (Dr.GRPO, Liu et
al. 2025, drops the division). Every model token of the trajectory gets it.

The policy loss is PPO's clipped surrogate (Schulman et al. 2017) with
asymmetric bounds (DAPO's clip-higher), corrected for the gap between the
behaviour policy μ that sampled the tokens (an older version, and a different
engine) and π_old, the learner's policy at the start of the step:

    ratio_t    = π_θ(a_t) / π_old(a_t)
    is_weight_t = min(π_old(a_t) / μ(a_t), C)          (truncated IS, detached)
    L = -mean_t  is_weight_t · min(ratio_t · A, clip(ratio_t, 1-ε_low, 1+ε_high) · A)

This is the decoupled objective of AReaL (Fu et al. 2025) with π_old as the
proximal policy; with one optimizer step per batch π_old is π_θ detached, so the
ratio is 1 in value and the loss reduces to truncated-IS policy gradient, with
no extra forward pass. C = 0 disables the correction (is_weight = 1).
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards: [N, G] (N groups of G) -> advantages [N, G].

    A_i = (r_i - mean(r)) / (std(r) + eps), std unbiased=False; without
    normalize_std, A_i = r_i - mean(r) (Dr.GRPO).
    """
    assert rewards.dim() == 2, "rewards must be [groups, group_size]"
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [N, G]
    if not normalize_std:
        return centred
    return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(tokens[:, t+1] | tokens[:, :t+1]) aligned to the *predicted* token.

    logits: [B, T, V] for inputs tokens [B, T] -> [B, T] where entry t is the
    log-prob of tokens[:, t]; entry 0 (no prediction) is 0.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T-1, V]
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T-1]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # [B, T]


AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Reduce [B, T] per-token terms to a scalar.

    token_mean: Σ_bt x·m / Σ_bt m (every token weighs the same; DAPO).
    seq_mean_token_mean: (1/B) Σ_b (Σ_t x·m / Σ_t m) (every trajectory weighs the same;
    the GRPO paper's form). On multi-turn tasks where failures run to the step
    limit, token_mean lets long failures outweigh short successes.
    """
    if how == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if how == "seq_mean_token_mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    raise ValueError(f"unknown loss aggregation {how!r}; choose one of {AGGREGATIONS}")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, clip_low: float = 0.2,
                clip_high: float = 0.28, is_cap: float = 2.0,
                aggregation: str = "token_mean") -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with truncated importance weights, aggregated over the batch.

    logprobs: [B, T] log π_θ (with grad); old_logprobs: [B, T] log π_old;
    behaviour_logprobs: [B, T] log μ; advantages: [B]; mask: [B, T] 1 on trained tokens.
    """
    mask = mask.float()
    n = mask.sum().clamp(min=1.0)
    adv = advantages[:, None].float()  # [B, 1]
    ratio = torch.exp(logprobs - old_logprobs.detach())  # [B, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # [B, T]
    log_w = (old_logprobs - behaviour_logprobs).detach()  # log π_old/μ
    is_weight = torch.exp(log_w).clamp(max=is_cap) if is_cap > 0 else torch.ones_like(log_w)
    loss = -aggregate(is_weight * surrogate, mask, aggregation)
    with torch.no_grad():
        m = mask.bool()
        w = is_weight[m] if m.any() else torch.zeros(1)
        metrics = {
            "loss": float(loss),
            "clip_fraction": float(((ratio != clipped).float() * mask).sum() / n),
            "is_weight_mean": float(w.mean()),
            "is_weight_max": float(w.max()),
            # k1 estimate of KL(μ || π_old) on the sampled tokens: the behaviour/learner mismatch
            "mismatch_kl": float(((behaviour_logprobs - old_logprobs) * mask).sum() / n),
            "entropy_proxy": float((-logprobs.detach() * mask).sum() / n),
        }
    return loss, metrics
