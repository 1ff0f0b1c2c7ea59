"""A learner step's bookkeeping: which rows it trains on, what it fixes at its start, how it
cuts them into micro-batches and weighs each one, and how the step metrics are summed up and
reduced across ranks. No model, no process group: the trainer (learner/trainer.py) runs the
passes and the collectives.

Gradient accumulation must equal one pass over the whole batch. Each loss term is an
aggregation over the action tokens (learner/losses.py `aggregate`), so a micro-batch c's
loss L_c, weighted by

    token_mean                share_c = k · n_c / N    (n_c action tokens of c, N of the batch)
    seq_mean_token_mean,
    seq_mean_token_sum_norm   share_c = k · b_c / B    (b_c trajectories of c, B of the batch)

sums to k · L(batch), k the number of mini-batches (so that every update is full scale).
N and B count the whole of the rank's batch: the trajectories the step skips (zero advantage)
are zero terms of the full-batch loss, and the tokens a correction drops count in its
denominators too (learner/losses.py), so the shares are known before any forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOTALS = ("tokens", "trajectories")
"""Step metrics summed over ranks; `*_max` take the maximum, `*_min` the minimum, the rest the mean."""


@dataclass
class StartOfStep:
    """What stays fixed through a step's mini-batches (computed without grad)."""

    old: torch.Tensor | None                # [B, T] log π_old; None: π_θ detached (one mini-batch)
    advantages: torch.Tensor                # [B] group estimators, or [B, T] (GAE; step advantages)
    old_values: torch.Tensor | None = None  # [B, T] V_old (ppo)
    returns: torch.Tensor | None = None     # [B, T] GAE returns (ppo)


def trained_rows(batch, critic: bool, mini_batches: int) -> tuple[list[int], list[list[int]]]:
    """The rows of `batch` (a learner.batch.Batch) a step trains on, and their mini-batches.

    Without a critic, a trajectory with zero advantage on every token (its group's rewards were
    all equal, and no turn's step advantage differs from 0) adds nothing to the gradient: it is
    skipped, no forward pass. PPO's critic learns from
    every trajectory with action tokens. Rows are sorted by length so that similar lengths
    share a micro-batch; mini-batch k takes every k-th, so each spans all lengths.
    """
    adv = batch.advantages
    keep = batch.mask.sum(1) > 0 if critic else (adv.abs() if adv.dim() == 1 else adv.abs().amax(1)) > 1e-8
    live = keep.nonzero().flatten().tolist()
    live.sort(key=lambda i: int(batch.attention[i].sum()))
    return live, [live[k::mini_batches] for k in range(mini_batches)]


def micro_batches(rows: list[int], size: int) -> list[list[int]]:
    """`rows` in consecutive micro-batches of at most `size`."""
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def token_micro_batches(rows: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """`rows` in consecutive micro-batches whose padded size, rows × the longest row's length,
    stays within `budget` tokens; a row longer than `budget` goes alone. lengths[i] is row i's
    length. `rows` come sorted by length (`trained_rows`), so consecutive rows pad little."""
    assert budget > 0, "a token budget is positive"
    out: list[list[int]] = []
    longest = 0
    for i in rows:
        if out and (len(out[-1]) + 1) * max(longest, lengths[i]) <= budget:
            out[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            out.append([i])
            longest = lengths[i]
    return out


def shares(chunks: list[list[int]], mask: torch.Tensor, aggregation: str, scale: int = 1) -> list[float]:
    """Each micro-batch's weight in the rank's loss (module docstring). mask: [B, T], the
    action tokens of the rank's whole batch; chunks: row indices into it."""
    if aggregation == "token_mean":
        total = float(mask.sum()) or 1.0
        return [scale * float(mask[c].sum()) / total for c in chunks]
    return [scale * len(c) / mask.shape[0] for c in chunks]


def reduce_metrics(keys: list[str], gathered: torch.Tensor) -> dict[str, float]:
    """Step metrics of every rank, gathered: [world, K] (row r is rank r's values of `keys`),
    into one dict: totals summed, maxima and minima as such, everything else averaged."""
    out = {}
    for k, column in zip(keys, gathered.double().unbind(1)):
        if k in TOTALS:
            out[k] = float(column.sum())
        elif k.endswith("_max"):
            out[k] = float(column.max())
        elif k.endswith("_min"):
            out[k] = float(column.min())
        else:
            out[k] = float(column.sum()) / column.numel()
    return out


class StepSums:
    """The rank's running sums over a step's micro-batches: share-weighted metrics (so they
    come out as the batch's), the loss, the largest importance weight, gradient norms."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.share = 0.0
        self.loss = 0.0
        self.is_weight_max = 0.0
        self.norms: list[float] = []
        self.critic_norms: list[float] = []

    def add(self, loss: float, metrics: dict[str, float], share: float) -> None:
        """One micro-batch: its loss and metrics (`is_weight_max` among them), weighted by its share."""
        metrics = dict(metrics)
        self.loss += loss * share
        self.share += share
        self.is_weight_max = max(self.is_weight_max, metrics.pop("is_weight_max"))
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * share

    def means(self) -> dict[str, float]:
        """The share-weighted mean of every metric."""
        return {k: v / (self.share or 1.0) for k, v in self.sums.items()}


def step_metrics(batch, live: list[int], sums: StepSums, mini_batches: int) -> dict[str, float]:
    """A rank's step metrics before the reduction across ranks: the micro-batches' means from
    `sums`, and figures of its batch (`live`: the rows it trained on)."""
    n = batch.tokens.shape[0]
    local = {
        **sums.means(), "loss": sums.loss / mini_batches, "is_weight_max": sums.is_weight_max,
        "grad_norm": sum(sums.norms) / len(sums.norms), "trained_fraction": len(live) / n,
        "reward_mean": float(batch.rewards.mean()),
        "staleness_mean": float(batch.staleness.mean()),
        "staleness_max": float(batch.staleness.max()),
        "tokens": float(batch.mask.sum()), "trajectories": float(n),
        "seq_len_mean": float(batch.attention.sum(1).float().mean()),
    }
    if sums.critic_norms:
        local["critic_grad_norm"] = sum(sums.critic_norms) / len(sums.critic_norms)
    if batch.step_share is not None:
        local["step_share"] = batch.step_share
    return local
