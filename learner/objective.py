"""The policy objective of one micro-batch under the learner's settings: the corrected, clipped
surrogate, the entropy bonus and the KL to the reference, assembled from the pure functions of
learner/losses.py. Tensors in, `(loss, metrics)` out; the trainer runs the forward passes (the log-probs and
entropy of learner/logprobs.py, and the critic's value loss, which needs a pass of its own) and
the backward.

    L = L_policy(correction) − c_H · H + c_KL · KL(π_θ ‖ π_ref)

every term aggregated over the micro-batch's action tokens the same way (--learner.aggregation),
so that the trainer's shares (learner/plan.py) sum micro-batches to the batch's loss.
"""

from __future__ import annotations

import torch

from learner.config import LearnerConfig
from learner.losses import aggregate, correct, kl_penalty, mismatch_kl, policy_loss


def policy_objective(cfg: LearnerConfig, correction: str, logprobs: torch.Tensor, entropy: torch.Tensor,
                     mask: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                     old_logprobs: torch.Tensor | None = None,
                     ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """logprobs: [b, T] log π_θ of the tokens (with grad); entropy: [b, T] of π_θ at the
    temperature (with grad when cfg.entropy_coef > 0, else a metric), both aligned to the predicted
    token (learner/logprobs.py); mask, behaviour (log μ): [b, T]; advantages: [b] or [b, T];
    old_logprobs: [b, T] log π_old, None for π_θ detached (one mini-batch a step); ref_logprobs:
    [b, T] log π_ref, needed when cfg.kl_coef > 0."""
    old = old_logprobs if old_logprobs is not None else logprobs.detach()
    corr = correct(correction, old, behaviour, mask, cfg.is_cap, cfg.geo_bound, cfg.drop_cap)
    loss, m = policy_loss(logprobs, corr, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                          cfg.aggregation, cfg.norm_length, cfg.behaviour_clip)
    entropy = aggregate(entropy, mask, cfg.aggregation, cfg.norm_length)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy
    if cfg.kl_coef > 0:
        assert ref_logprobs is not None, "a KL term needs the reference log-probs"
        kl = aggregate(kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator), mask, cfg.aggregation, cfg.norm_length)
        loss = loss + cfg.kl_coef * kl
        m["kl_ref"] = float(kl.detach())
    m["entropy"] = float(entropy.detach())
    m["mismatch_kl"] = mismatch_kl(old, behaviour, mask)
    m["masked_fraction"] = float(1.0 - corr.mask.sum() / mask.sum().clamp(min=1.0))
    return loss, m
