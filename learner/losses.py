"""Advantages, policy and value losses, regularisers, corrections: pure functions.

Tensors in, tensors (or `(loss, metrics)`) out; no model, no process group.
Shapes: B trajectories, T tokens (padded), N groups of G trajectories. Token t
of a [B, T] tensor refers to the token *at* t (log-probs are aligned to the
predicted token, see `token_logprobs`); `mask` is 1 on model (action) tokens.

Three policies meet in the loss:
    μ        the behaviour policy that sampled the tokens (an older version, and a
             different engine: its log-probs come with the trajectory),
    π_old    the learner's policy at the start of the step (the proximal policy
             π_prox of decoupled PPO),
    π_θ      the policy being optimised.
With one mini-batch a step, π_old is π_θ detached: no extra forward pass.

Design decisions and departures:
- `correction="none"` is naive asynchronous PPO: μ itself is the trust-region
  anchor (ratio π_θ/μ), as in a synchronous PPO that skips the recompute.
- `decoupled` is `tis` plus AReaL's filter: its weight π_prox/μ is clamped at C
  exactly as tis clamps π_old/μ (π_prox is π_old), and on top of that tokens
  whose π_prox/μ exceeds `drop_cap` are dropped (weight 0). AReaL's code only
  filters (behav_imp_weight_cap); the clamp is ours.
- A dropped token (decoupled's filter, geo-mask's rejected trajectories) is a
  zero term of the loss; it still counts in the aggregation's denominators, as
  in AReaL, where the token count is taken before the filter. So a token's
  weight never depends on which other tokens were dropped, the denominators
  are known before any forward pass, and a batch cut into micro-batches sums
  to the same loss as the batch in one piece (see learner/plan.py).
- Advantages for multi-turn PPO run over the action tokens of an episode in
  order; observation and prompt tokens are skipped (they carry no action), so
  the value of the next action is the bootstrap target across a turn boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from learner.config import AGGREGATIONS, ALGOS, CORRECTIONS, KL_ESTIMATORS  # noqa: F401  (the choices)


# -- advantages -----------------------------------------------------------------

def _uniform_to_zero(rewards: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Advantages [N, G] with every group whose rewards are all equal set to exactly 0, in
    the rewards' float dtype (float32 when they are not floats).

    A group of equal rewards carries no signal, but its mean, rounded, is not quite its
    rewards: eight float32 rewards of 0.7 gave GRPO advantages of 0.056 each (the rounding
    error over a std of the same size plus eps), all one sign, so the whole group was pushed
    one way, and RLOO gave 6e-8, above the trainer's skip threshold. Float64 shrinks the
    error; the equality test removes it.
    """
    uniform = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # [N, 1]
    out = torch.where(uniform, torch.zeros_like(advantages), advantages)
    return out.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def grpo_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024): rewards [N, G] -> advantages [N, G].

    A_i = (r_i − mean(r)) / (std(r) + eps), std with unbiased=False; without
    normalize_std, A_i = r_i − mean(r) (Dr.GRPO, Liu et al. 2025). Computed in
    float64; a group whose rewards are all equal gets A = 0 exactly.
    """
    assert rewards.dim() == 2, "rewards must be [groups, group_size]"
    r = rewards.double()
    centred = r - r.mean(dim=1, keepdim=True)  # [N, G]
    if normalize_std:
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return _uniform_to_zero(rewards, centred)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): rewards [N, G] -> advantages [N, G].

    A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j = G/(G−1) · (r_i − mean(r)): each sample's
    baseline is the mean of the others, so it is unbiased. Computed in float64; a
    group whose rewards are all equal gets A = 0 exactly.
    """
    assert rewards.dim() == 2 and rewards.shape[1] >= 2, "rewards must be [groups, group_size ≥ 2]"
    g = rewards.shape[1]
    r = rewards.double()
    others = (r.sum(dim=1, keepdim=True) - r) / (g - 1)  # [N, G]
    return _uniform_to_zero(rewards, r - others)


def group_advantages(rewards: torch.Tensor, algo: str, normalize_std: bool = True) -> torch.Tensor:
    """The factory for the critic-free estimators: rewards [N, G] -> advantages [N, G]."""
    if algo == "grpo":
        return grpo_advantages(rewards, normalize_std)
    if algo == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"no group advantage for --algo {algo!r}; choose grpo or rloo (ppo uses the critic)")


def step_advantages(anchors: list, turn_rewards: list, gamma: float, normalize_std: bool = True,
                    eps: float = 1e-6) -> list[np.ndarray]:
    """GiGPO's step-level advantages (Feng et al. 2025) of one group: per trajectory, one per turn.

    anchors[i][t] is the state turn t of trajectory i was played from, turn_rewards[i][t] its
    reward. A turn's return is Σ_k γ^k r_(t+k) (its own reward and the later ones); the turns of
    the whole group played from the same state form a step group, and each turn's advantage is
    its return against that group's, (R − mean) / (std + eps) (without normalize_std, R − mean).
    A turn alone in its step group, or in one whose returns are all equal, gets exactly 0.
    Computed in float64.
    """
    returns = []
    for rewards in turn_rewards:
        out, acc = np.zeros(len(rewards)), 0.0
        for t in range(len(rewards) - 1, -1, -1):
            acc = float(rewards[t]) + gamma * acc
            out[t] = acc
        returns.append(out)
    members: dict[int, list[tuple[int, int]]] = {}
    for i, keys in enumerate(anchors):
        for t, key in enumerate(keys):
            members.setdefault(int(key), []).append((i, t))
    advantages = [np.zeros(len(r)) for r in returns]
    for turns in members.values():
        r = np.array([returns[i][t] for i, t in turns])
        if len(turns) < 2 or (r == r[0]).all():
            continue
        centred = r - r.mean()
        if normalize_std:
            centred = centred / (r.std() + eps)
        for (i, t), a in zip(turns, centred):
            advantages[i][t] = a
    return advantages


def turn_index(mask: np.ndarray) -> np.ndarray:
    """mask [T] (1 on model tokens) -> [T]: each model token's turn, counted from 0 by the runs of
    1s (a turn's reply is one run: observation tokens, mask 0, separate two); -1 off the mask."""
    m = np.asarray(mask).astype(bool)
    starts = m & ~np.concatenate([[False], m[:-1]])
    return np.where(m, np.cumsum(starts) - 1, -1)


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sparse episode rewards [B] as token-level rewards [B, T]: r on the episode's last
    action token, 0 elsewhere (a row without action tokens gets none)."""
    mask = mask.float()
    t = mask.shape[1]
    last = (mask * torch.arange(1, t + 1, dtype=mask.dtype)).argmax(dim=1)  # [B] index of the last action
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = rewards.to(mask.dtype) * (mask.sum(1) > 0)
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) over the action tokens of multi-turn episodes.

    rewards, values, mask: [B, T] -> (advantages, returns) [B, T], zero off the mask.
    With t' the next action token after t (skipping observation tokens) and V = 0
    after the last one:
        δ_t = r_t + γ·V_{t'} − V_t,     A_t = δ_t + γλ·A_{t'},     R_t = A_t + V_t.
    """
    mask = mask.float()
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # [B]
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    return adv, (adv + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / (std + eps) over the masked entries (population std); zero off the mask."""
    mask = mask.float()
    n = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) / (var.sqrt() + eps) * mask


# -- per-token terms --------------------------------------------------------------

def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(tokens[:, t] | tokens[:, :t]) aligned to the *predicted* token.

    logits: [B, T, V] for inputs tokens [B, T] -> [B, T] where entry t is the
    log-prob of tokens[:, t]; entry 0 (no prediction) is 0.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T-1, V]
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T-1]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # [B, T]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H_t = −Σ_v π(v | tokens[:, :t]) log π(v | ·), aligned like `token_logprobs`: [B, T, V] -> [B, T]."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T-1, V]
    h = -(logp.exp() * logp).sum(-1)  # [B, T-1]
    return torch.cat([torch.zeros_like(h[:, :1]), h], dim=1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) on tokens sampled from π_θ (Schulman 2020,
    "Approximating KL divergence"). With log ρ = log π_ref − log π_θ:
        k1 = −log ρ,    k2 = ½ (log ρ)²,    k3 = (ρ − 1) − log ρ.
    k1 is unbiased but can be negative; k3 is unbiased and ≥ 0; k2 is biased, low variance.
    """
    log_rho = ref_logprobs - logprobs  # [B, T]
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho ** 2
    if estimator == "k3":
        return torch.exp(log_rho) - 1.0 - log_rho
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


# -- aggregation ------------------------------------------------------------------

def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, norm_length: int = 1024) -> torch.Tensor:
    """Reduce [B, T] per-token terms to a scalar.

    token_mean:               Σ_bt x·m / Σ_bt m (every token weighs the same; DAPO).
    seq_mean_token_mean:      (1/B) Σ_b (Σ_t x·m / Σ_t m) (every trajectory weighs the same;
                              the GRPO paper's form).
    seq_mean_token_sum_norm:  (1/B) Σ_b Σ_t x·m / L with L = norm_length a constant
                              (Dr.GRPO: no length bias from a per-sequence denominator).
    On multi-turn tasks where failures run to the step limit, token_mean lets long
    failures outweigh short successes.
    """
    mask = mask.float()
    if how == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if how == "seq_mean_token_mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if how == "seq_mean_token_sum_norm":
        return (per_token * mask).sum(1).mean() / norm_length
    raise ValueError(f"unknown loss aggregation {how!r}; choose one of {AGGREGATIONS}")


# -- staleness / mismatch correction --------------------------------------------------

@dataclass
class Correction:
    """What a correction hands the policy loss (all detached)."""

    old_logprobs: torch.Tensor  # [B, T] the trust-region anchor of the ratio π_θ / anchor
    is_weight: torch.Tensor     # [B, T] importance weight multiplying the clipped surrogate
    mask: torch.Tensor          # [B, T] the loss mask after the correction dropped tokens
    behaviour: torch.Tensor | None = None  # [B, T] log μ, for the policy loss's --learner.behaviour-clip
    action_mask: torch.Tensor | None = None
    """[B, T] the action tokens before any was dropped: what the aggregation divides by (None: `mask`)."""


def correct(correction: str, old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
            mask: torch.Tensor, cap: float = 2.0, geo_bound: float = 1.1, drop_cap: float = 5.0) -> Correction:
    """Anchor, weights and mask for the gap between μ (behaviour) and π_old (start of step).

    With log w_t = log π_old(a_t) − log μ(a_t) on action tokens:
        none       anchor μ, w = 1 (naive async PPO: the trust region is around μ)
        tis        anchor π_old, w_t = min(exp(log w_t), C)            (Yao et al. 2025)
        seq-tis    anchor π_old, w_b = min(exp(Σ_t log w_t), C) on every token of b
        geo-mask   anchor π_old, w = 1, sequence b kept only if its geometric mean
                   ratio exp(mean_t log w_t) lies in [1/geo_bound, geo_bound]
        decoupled  anchor π_prox = π_old, w_t = min(exp(log w_t), C), tokens with
                   exp(log w_t) > drop_cap dropped (AReaL, Fu et al. 2025: the filter of
                   its behav_imp_weight_cap, on top of the truncated weight)

    C (`cap`) = 2 is the truncation of Yao et al.; `drop_cap` = 5 is the filter AReaL's
    configurations use. A dropped token loses its gradient both ways, so a filter as tight as
    2 also keeps the learner from pushing down what it has come to prefer since μ when the
    episode failed (README, "Staleness": at η = 8 it cost decoupled 30 points in one run).
    """
    mask = mask.float()
    old, mu = old_logprobs.detach(), behaviour_logprobs.detach()
    log_w = (old - mu) * mask  # [B, T]
    ones = torch.ones_like(log_w)
    if correction == "none":
        return Correction(mu, ones, mask, mu, mask)
    if correction == "tis":
        return Correction(old, torch.exp(log_w).clamp(max=cap), mask, mu, mask)
    if correction == "seq-tis":
        seq = torch.exp(log_w.sum(1, keepdim=True)).clamp(max=cap)  # [B, 1]
        return Correction(old, seq.expand_as(log_w).contiguous(), mask, mu, mask)
    if correction == "geo-mask":
        geo = torch.exp(log_w.sum(1) / mask.sum(1).clamp(min=1.0))  # [B]
        keep = ((geo >= 1.0 / geo_bound) & (geo <= geo_bound)).float()[:, None]  # [B, 1]
        return Correction(old, ones, mask * keep, mu, mask)
    if correction == "decoupled":
        w = torch.exp(log_w)
        keep = (w <= drop_cap).float()
        return Correction(old, w.clamp(max=cap) * keep, mask * keep, mu, mask)
    raise ValueError(f"unknown --correction {correction!r}; choose one of {CORRECTIONS}")


# -- losses ---------------------------------------------------------------------------

def policy_loss(logprobs: torch.Tensor, correction: Correction, advantages: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float = 0.0,
                aggregation: str = "token_mean", norm_length: int = 1024,
                behaviour_clip: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al. 2017), weighted and aggregated.

        ratio_t     = π_θ(a_t) / anchor(a_t)
        surrogate_t = min(ratio_t · A_t, clip(ratio_t, 1 − ε_low, 1 + ε_high) · A_t)
        dual-clip (Ye et al. 2020), c > 1, only where A_t < 0: surrogate_t = max(surrogate_t, c · A_t)
        behaviour clip, B > 1, with ρ_t = π_θ(a_t) / μ(a_t): surrogate_t carries no gradient
                    where A_t > 0 and ρ_t > B, or A_t < 0 and ρ_t < 1/B
        L = −aggregate(w_t · surrogate_t · kept_t) over the action tokens, kept_t = 0 where the
            correction dropped the token: the denominators count it all the same

    The behaviour clip bounds how far the corrected objectives (anchored at π_old) push a token
    past what the batch's own policy μ did: PPO's clip, one-sided like it, around μ and wider
    than ε. Without it, a batch η versions old keeps pulling a token the policy has already
    taken up since μ; no fresh sample has yet shown what that did (README, "Staleness").

    Asymmetric bounds (ε_high > ε_low) are DAPO's clip-higher. logprobs: [B, T] log π_θ
    (with grad); advantages: [B] (one per trajectory) or [B, T] (per token).
    """
    mask = correction.mask
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).float()  # [B, 1] or [B, T]
    ratio = torch.exp(logprobs - correction.old_logprobs)  # [B, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # [B, T]
    if dual_clip > 0:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)
    held = torch.zeros_like(mask, dtype=torch.bool)
    if behaviour_clip > 0:
        assert correction.behaviour is not None, "the behaviour clip needs the correction's log μ"
        log_rho = logprobs.detach() - correction.behaviour  # [B, T] log π_θ/μ
        bound = math.log(behaviour_clip)
        held = ((adv > 0) & (log_rho > bound)) | ((adv < 0) & (log_rho < -bound))
        surrogate = torch.where(held, surrogate.detach(), surrogate)
    # A dropped token is a zero term that still counts in the denominators (module docstring).
    counted = correction.action_mask if correction.action_mask is not None else mask
    weighted = torch.where(mask > 0, correction.is_weight * surrogate, torch.zeros_like(surrogate))  # [B, T]
    loss = -aggregate(weighted, counted, aggregation, norm_length)
    with torch.no_grad():
        m = mask > 0
        n = m.sum().clamp(min=1)
        w = correction.is_weight[m] if m.any() else torch.zeros(1)
        metrics = {
            "policy_loss": float(loss),
            "clip_fraction": float(((ratio != clipped) & m).sum() / n),
            "behaviour_clip_fraction": float((held & m).sum() / n),
            "is_weight_mean": float(w.mean()),
            "is_weight_max": float(w.max()),
        }
    return loss, metrics


def mismatch_kl(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(μ ‖ π) on the tokens μ sampled, k3 estimator (≥ 0): mean_t (ρ − 1 − log ρ), ρ = π/μ."""
    mask = mask.float()
    return float((kl_penalty(behaviour_logprobs, logprobs, "k3") * mask).sum() / mask.sum().clamp(min=1.0))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2, aggregation: str = "token_mean",
               norm_length: int = 1024) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (PPO2 baselines; Andrychowicz et al. 2021):

        V^clip_t = V_old,t + clip(V_t − V_old,t, −ε_v, ε_v)
        L_V = aggregate(½ · max((V_t − R_t)², (V^clip_t − R_t)²))

    values: [B, T] with grad; old_values, returns: [B, T]; clip ≤ 0 turns clipping off.
    """
    old, ret = old_values.detach(), returns.detach()
    err = (values - ret) ** 2
    if clip > 0:
        v_clip = old + (values - old).clamp(-clip, clip)
        err = torch.maximum(err, (v_clip - ret) ** 2)
    loss = aggregate(0.5 * err, mask, aggregation, norm_length)
    with torch.no_grad():
        m = mask > 0
        n = m.sum().clamp(min=1)
        clipped = ((values - old).abs() > clip) & m if clip > 0 else torch.zeros_like(m)
        metrics = {"value_loss": float(loss), "value_clip_fraction": float(clipped.sum() / n),
                   "explained_variance": explained_variance(values.detach(), ret, mask)}
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over the masked tokens (1: perfect, 0: no better than the mean)."""
    m = mask > 0
    if m.sum() < 2:
        return 0.0
    r, v = returns[m].double(), values[m].double()
    var = r.var(unbiased=False)
    return float(1.0 - (r - v).var(unbiased=False) / var) if var > 0 else 0.0
