"""The policy objective of one micro-batch under the learner's settings: the corrected, clipped
surrogate, the entropy bonus and the KL to the reference, assembled from the pure functions of
learner/losses.py. Tensors in, `(loss, metrics)` out; the trainer runs the forward passes (and
the critic's value loss, which needs a pass of its own) and the backward.

    L = L_policy(correction) − c_H · H + c_KL · KL(π_θ ‖ π_ref)

every term aggregated over the micro-batch's action tokens the same way (--learner.aggregation),
so that the trainer's shares (learner/plan.py) sum micro-batches to the batch's loss.
"""

from __future__ import annotations

import torch

from learner.config import LearnerConfig
from learner.losses import aggregate, correct, kl_penalty, mismatch_kl, policy_loss, token_entropy, token_logprobs


def policy_objective(cfg: LearnerConfig, correction: str, logits: torch.Tensor, tokens: torch.Tensor,
                     mask: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                     old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                     temperature: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """logits: [b, T, V] of π_θ (with grad) for tokens [b, T]; mask, behaviour (log μ): [b, T];
    advantages: [b] or [b, T]; old_logprobs: [b, T] log π_old, None for π_θ detached (one
    mini-batch a step); ref_logprobs: [b, T] log π_ref, needed when cfg.kl_coef > 0."""
    logp = token_logprobs(logits, tokens, temperature)  # [b, T]
    old = old_logprobs if old_logprobs is not None else logp.detach()
    corr = correct(correction, old, behaviour, mask, cfg.is_cap, cfg.geo_bound, cfg.drop_cap)
    loss, m = policy_loss(logp, corr, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                          cfg.aggregation, cfg.norm_length, cfg.behaviour_clip)
    with torch.set_grad_enabled(cfg.entropy_coef > 0):  # a metric only: no graph over [b, T, V]
        entropy = aggregate(token_entropy(logits, temperature), mask, cfg.aggregation, cfg.norm_length)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy
    if cfg.kl_coef > 0:
        assert ref_logprobs is not None, "a KL term needs the reference log-probs"
        kl = aggregate(kl_penalty(logp, ref_logprobs, cfg.kl_estimator), mask, cfg.aggregation, cfg.norm_length)
        loss = loss + cfg.kl_coef * kl
        m["kl_ref"] = float(kl.detach())
    m["entropy"] = float(entropy.detach())
    m["mismatch_kl"] = mismatch_kl(old, behaviour, mask)
    m["masked_fraction"] = float(1.0 - corr.mask.sum() / mask.sum().clamp(min=1.0))
    return loss, m
