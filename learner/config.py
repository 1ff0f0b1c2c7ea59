"""The learner's settings (`--learner.*`), read by tyro; the algorithm and the correction
are the headline flags `--algo` and `--correction` of the root config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from policy.choices import check_choices
from policy.load import LoraSpec

# The choices of the choice fields (policy/choices.py says how they are checked).
Algo = Literal["grpo", "rloo", "ppo"]
Correction = Literal["none", "tis", "seq-tis", "geo-mask", "decoupled"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KlEstimator = Literal["k1", "k2", "k3"]
LrSchedule = Literal["cosine", "linear", "constant"]
Dtype = Literal["auto", "float32", "bfloat16"]
ALGOS, CORRECTIONS, AGGREGATIONS, KL_ESTIMATORS, LR_SCHEDULES, DTYPES = map(
    get_args, (Algo, Correction, Aggregation, KlEstimator, LrSchedule, Dtype))

# The adapters a learner trains: the policy's and, for PPO, the critic's.
POLICY, CRITIC = "default", "critic"
"""PEFT adapter names: the policy (published to actors) and PPO's critic (never published)."""

DEFAULT_ALGO: Algo = "grpo"
DEFAULT_CORRECTION: Correction = "none"
"""The defaults of --algo and --correction, held here once: the root config (launch/config.py)
and `Learner` both take them, so a learner built directly (a test, a benchmark) trains what the
default run trains. Why "none": see the root config's --correction."""


def lr_factor(schedule: str, step: int, horizon: int | None, final: float) -> float:
    """The learning rate of optimizer step `step` (0-based) of `horizon`, as a fraction of the base:

        constant  1
        linear    1 − (1 − final)·p
        cosine    final + (1 − final)·(1 + cos(π·p))/2
    with p = min(step / (horizon − 1), 1), so the first step uses the base rate and the last
    `final`. No horizon (a learner driven step by step without a budget): 1.
    """
    import math

    if schedule == "constant" or not horizon or horizon <= 1:
        return 1.0
    p = min(step / (horizon - 1), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - final) * p
    if schedule == "cosine":
        return final + (1.0 - final) * (1.0 + math.cos(math.pi * p)) / 2.0
    raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {LR_SCHEDULES}")


@dataclass
class LearnerConfig:
    """The learner (FSDP ranks, LoRA, losses). The algorithm and the correction are the
    headline flags --algo and --correction."""

    lr: float = 1.5e-3
    """AdamW learning rate for the LoRA weights."""
    lr_schedule: LrSchedule = "cosine"
    """Learning-rate schedule over the run's --steps: "cosine" (from --learner.lr down to
    --learner.lr-final × lr at the last step), "linear" (the same, in a straight line) or "constant"."""
    lr_final: float = 0.1
    """The schedule's last learning rate, as a fraction of --learner.lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    groups_per_step: int = 0
    """Groups (tasks) per optimizer step, across all ranks (B). 0 scales it from the GPUs given: 128
    sequences on the CPU, ceil(128 / group_size) (16 groups of 8; 8 of 16); with actors on GPUs,
    enough that the staleness bound admits every actor's groups in flight, ceil(--actors ×
    groups-in-flight / (η + 1)) rounded up to a multiple of --learners, at least the CPU's (4
    actors on whole GPUs, G 8, η 1: 64); with --colocate and --learner.gpus g,
    --learners × ceil(256·g / group_size) (8 ranks on whole GPUs, G 8: 256), which each rank plays
    at once. A number given wins."""
    mini_batches: int = 1
    """Optimizer updates per batch (PPO's mini-batches); the policy version still advances once per
    batch. Above 1, π_old needs its own forward pass at the start of the step."""
    clip_low: float = 0.2
    """PPO clip ε_low: the ratio is kept above 1 − ε_low."""
    clip_high: float = 0.28
    """PPO clip ε_high (clip-higher): the ratio is kept below 1 + ε_high."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (0 = off)."""
    behaviour_clip: float = 0.0
    """B > 1: a token stops pulling once π_θ/μ has left [1/B, B] in its advantage's direction, μ
    being the policy that generated the batch (0 = off). A bound for the corrected objectives,
    whose clip is anchored at π_old, on how far a stale batch moves the policy."""
    is_cap: float = 2.0
    """C of tis, seq-tis and decoupled: they clamp the weight π_old/μ at C (--correction none
    turns correction off)."""
    drop_cap: float = 5.0
    """decoupled also drops tokens whose π_prox/μ exceeds this (AReaL's behav_imp_weight_cap)."""
    geo_bound: float = 1.1
    """geo-mask keeps a trajectory when the geometric mean of π_old/μ over its tokens is in
    [1/geo_bound, geo_bound]."""
    aggregation: Aggregation = "seq_mean_token_mean"
    """Loss aggregation: "seq_mean_token_mean" (each trajectory weighs the same, as in the GRPO
    paper), "token_mean" (each token weighs the same, as in DAPO) or "seq_mean_token_sum_norm"
    (token sums over a constant --learner.norm-length, as in Dr.GRPO)."""
    norm_length: int = 1024
    """The constant length L of seq_mean_token_sum_norm."""
    normalize_std: bool = True
    """Divide GRPO advantages by the group's reward std; off gives Dr.GRPO."""
    step_weight: float = 0.0
    """GiGPO (Feng et al. 2025): ω of the step-level advantage added to every turn's tokens
    beside the group's episode-level one (0 = off). The turns of a group played from the same
    state (the environment's `info["state"]`, else the same observation) form a step group, and a
    turn's step advantage is its discounted return against theirs, so a move that wastes a turn
    or leads away from the goal is pushed down inside an episode that succeeds. For grpo and rloo."""
    step_gamma: float = 0.95
    """GiGPO: γ of a turn's return, Σ_k γ^k r_(t+k) over the turn's own reward and the later ones."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference policy (the model with the adapter disabled) in the loss
    (0 = off, no reference forward pass)."""
    kl_estimator: KlEstimator = "k3"
    """KL estimator of the reference term: "k1", "k2" or "k3"."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0 = off; entropy is still reported)."""
    gamma: float = 1.0
    """PPO: discount per action token in GAE."""
    lam: float = 0.95
    """PPO: GAE λ."""
    value_clip: float = 0.2
    """PPO: the value prediction is clipped to V_old ± this (0 = off)."""
    vf_coef: float = 0.5
    """PPO: weight of the value loss."""
    critic_lr: float = 1e-3
    """PPO: AdamW learning rate of the critic (its LoRA adapter and value head)."""
    whiten_advantages: bool = True
    """PPO: normalise GAE advantages to mean 0, std 1 over each rank's action tokens."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm, policy and critic separately (0 = off)."""
    micro_batch: int = 8
    """Trajectories per forward/backward pass on a rank (gradient accumulation above it). Rows are
    sorted by length first, so each pass pads only to its own longest row; small passes waste
    little on padding and keep the [b, heads, T, T] attention small."""
    micro_batch_tokens: int = 0
    """Size micro-batches by tokens instead of rows (0 = off: --learner.micro-batch rows): each pass
    takes as many length-sorted rows as keep rows × its longest row within this many tokens; a row
    longer than that goes alone. Memory follows tokens, so long and short trajectories share one budget."""
    logit_chunk: int = 1024
    """Token positions per chunk of the output head: log-probs and entropy are computed from the last
    hidden state chunk by chunk, each recomputed in the backward, so no [tokens, vocabulary] float32
    tensor of the whole micro-batch ever exists (0 = the whole micro-batch's logits at once)."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"cpu", "cuda" or "auto" (cuda when available)."""
    gpus: float = 0.0
    """GPUs each learner rank asks Ray for (0 = the CPU, gloo); above 0 the ranks train on CUDA with
    NCCL, each seeing only its own GPU. A fraction (0.5) shares a GPU with actors; with several
    --learners give each rank a whole GPU (NCCL needs a device per rank)."""
    threads: int = 1
    """Torch CPU threads per learner process."""
    dtype: Dtype = "auto"
    """Weights and compute: "bfloat16" (frozen base weights stored in bf16, compute in bf16 through
    FSDP2's mixed precision; LoRA weights, the critic, gradient reduction and AdamW state stay
    float32), "float32", or "auto" (bfloat16 on CUDA, float32 on the CPU)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input in the forward and recompute the layer in the backward:
    activation memory of one layer instead of all, for about a third more compute."""
    fused_lora: bool = True
    """Compute a LoRA layer as one linear map with the weight W + (alpha/r)·B·A, built at each
    forward, where the adapter is not thin next to W (r·(in+out) ≥ in·out/3: the built-in models'
    layers at rank 32, not a 0.5B model's) and compute is float32: the same values and gradients
    as PEFT's separate path, whose extra products, scale and sum cost more there
    (docs/models.md). False: PEFT's path everywhere."""
    keep_gathered: Literal["auto", "on", "off"] = "auto"
    """Gradient accumulation with fewer collectives: the parameters FSDP gathers for an optimizer
    update's first micro-batch stay gathered until its last, and gradients are reduced once, after
    the last: per FSDP unit one all-gather and one reduce-scatter an update, instead of two
    all-gathers and a reduce-scatter every micro-batch. The cost is the whole model in every
    rank's memory during the update. "auto": on with the CPU (gloo), where models are small and
    every collective waits for a busy core; off with CUDA, where FSDP's sharding is what lets a
    model fit. The same updates either way."""
    save_every: int = 0
    """Save the adapter under --logdir every this many steps (0 = only at the end)."""
    restarts: int = 2
    """Times the learner group is brought back from its newest checkpoint after a rank dies; past
    that the run stops with the --resume command that continues it."""

    @property
    def num_gpus(self) -> float:
        """GPUs of one rank: --learner.gpus, or 1 with --learner.device cuda."""
        return self.gpus if self.gpus > 0 else (1.0 if self.device == "cuda" else 0.0)

    def __post_init__(self) -> None:
        check_choices(self, "--learner.")
        if self.lr <= 0 or self.critic_lr <= 0:
            raise ValueError(f"--learner.lr and --learner.critic-lr must be positive, got {self.lr}, {self.critic_lr}")
        if not 0 <= self.lr_final <= 1:
            raise ValueError(f"--learner.lr-final is a fraction of --learner.lr in [0, 1], got {self.lr_final}")
        if self.groups_per_step < 0:
            raise ValueError(f"--learner.groups-per-step must be 0 (scaled from the GPUs) or more, got "
                             f"{self.groups_per_step}")
        if self.mini_batches < 1:
            raise ValueError(f"--learner.mini-batches must be at least 1, got {self.mini_batches}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("--learner.clip-low must be in [0, 1) and --learner.clip-high ≥ 0")
        if self.dual_clip != 0 and self.dual_clip <= 1:
            raise ValueError(f"--learner.dual-clip must be 0 (off) or above 1, got {self.dual_clip}")
        if self.behaviour_clip != 0 and self.behaviour_clip <= 1:
            raise ValueError(f"--learner.behaviour-clip must be 0 (off) or above 1, got {self.behaviour_clip}")
        if self.is_cap <= 0 or self.drop_cap <= 1:
            raise ValueError(f"--learner.is-cap must be positive and --learner.drop-cap above 1, got "
                             f"{self.is_cap} and {self.drop_cap}; use --correction none to turn the correction off")
        if self.geo_bound <= 1:
            raise ValueError(f"--learner.geo-bound must be above 1, got {self.geo_bound}")
        if self.micro_batch < 1:
            raise ValueError(f"--learner.micro-batch must be at least 1, got {self.micro_batch}")
        if self.micro_batch_tokens < 0 or self.logit_chunk < 0:
            raise ValueError(f"--learner.micro-batch-tokens and --learner.logit-chunk must be 0 (off) or positive, "
                             f"got {self.micro_batch_tokens} and {self.logit_chunk}")
        if self.norm_length < 1:
            raise ValueError(f"--learner.norm-length must be at least 1, got {self.norm_length}")
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.vf_coef < 0:
            raise ValueError("--learner.kl-coef, --learner.entropy-coef and --learner.vf-coef must be ≥ 0")
        if not (math.isfinite(self.step_weight) and self.step_weight >= 0 and 0 < self.step_gamma <= 1):
            raise ValueError(f"--learner.step-weight must be ≥ 0 and --learner.step-gamma in (0, 1], got "
                             f"{self.step_weight:g} and {self.step_gamma:g}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"--learner.gamma and --learner.lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.restarts < 0:
            raise ValueError(f"--learner.restarts must be 0 or more, got {self.restarts}")
        if not 0 <= self.gpus <= 1 or (self.gpus > 0 and self.device == "cpu"):
            raise ValueError(f"--learner.gpus is the GPUs of one rank, in [0, 1] (a rank trains on one device), "
                             f"and needs --learner.device auto or cuda; got {self.gpus:g} with {self.device}")
