"""The Tinker API's built-in losses: pure functions of one datum's tensors.

Each takes the policy's log-probs of the datum's `target_tokens` ([N], with a gradient) and the
datum's other `loss_fn_inputs` ([N] each), and returns the datum's loss (a scalar, a *sum* over
its tokens: the API sums, it never averages) and its per-token terms. The formulas are those the
Tinker documentation gives (https://tinker-docs.thinkingmachines.ai/losses):

    cross_entropy        −Σ_t w_t · log π(x_t)                                  (inputs: weights)
    importance_sampling  −Σ_t (π(x_t) / q(x_t)) · A_t                        (logprobs, advantages)
    ppo                  −Σ_t min(ρ_t A_t, clip(ρ_t, lo, hi) A_t),  ρ_t = π(x_t) / q(x_t)

q is the sampler's log-prob (`logprobs` in the inputs). PPO's thresholds `clip_low_threshold` /
`clip_high_threshold` come from `loss_fn_config` and default to 0.8 / 1.2 (ε = 0.2, Schulman et
al. 2017). Tandem's learner aggregates its losses differently (learner/losses.py: per-token
means, corrections), so these three are the API's own.
"""

from __future__ import annotations

from typing import Callable

import torch

LOSSES = ("cross_entropy", "importance_sampling", "ppo")
"""The losses this service computes (the SDK also names cispo, dro, gspo, stable_reinforce and
custom, which it refuses with a user error)."""

INPUTS = {"cross_entropy": ("target_tokens", "weights"),
          "importance_sampling": ("target_tokens", "logprobs", "advantages"),
          "ppo": ("target_tokens", "logprobs", "advantages")}
"""The `loss_fn_inputs` each loss needs (cross_entropy's weights default to 1)."""

CONFIG = {"cross_entropy": (), "importance_sampling": (), "ppo": ("clip_low_threshold", "clip_high_threshold")}
"""The `loss_fn_config` keys each loss reads; any other key is refused."""


def cross_entropy(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """−Σ_t w_t · log π(x_t): logp [N], inputs["weights"] [N] -> (loss [], per-token [N])."""
    weights = inputs.get("weights")
    if weights is None:
        weights = torch.ones_like(logp)
    per_token = -weights * logp  # [N]
    return per_token.sum(), per_token


def importance_sampling(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """−Σ_t exp(log π − log q)_t · A_t (REINFORCE with the sampler's importance weight)."""
    ratio = torch.exp(logp - inputs["logprobs"])  # [N]
    per_token = -ratio * inputs["advantages"]
    return per_token.sum(), per_token


def ppo(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """−Σ_t min(ρ_t A_t, clip(ρ_t, lo, hi) A_t), ρ = π/q; lo, hi from the config (0.8, 1.2)."""
    lo = float(config.get("clip_low_threshold", 0.8))
    hi = float(config.get("clip_high_threshold", 1.2))
    ratio = torch.exp(logp - inputs["logprobs"])  # [N]
    clipped = ratio.clamp(lo, hi)
    advantages = inputs["advantages"]
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    return per_token.sum(), per_token


def loss_fn(name: str, config: dict) -> Callable:
    """The loss called `name`, after checking its config; ValueError (a user error) naming what
    is wrong."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss_fn {name!r}; this service computes {', '.join(LOSSES)}")
    extra = sorted(set(config) - set(CONFIG[name]))
    if extra:
        raise ValueError(f"loss_fn_config {extra} is not read by {name} (it reads {list(CONFIG[name]) or 'nothing'})")
    for key, value in config.items():
        if not isinstance(value, (int, float)):
            raise ValueError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
    if name == "ppo":
        lo, hi = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
        if not 0.0 <= lo <= 1.0 <= hi:
            raise ValueError(f"ppo's clip thresholds are ratios with low <= 1 <= high, got {lo} and {hi}")
    return {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo}[name]
