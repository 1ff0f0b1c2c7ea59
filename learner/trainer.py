"""The learner: FSDP2 over N ranks training a LoRA policy with GRPO.

Each rank is one process. Ranks join one torch.distributed group (gloo on CPU,
NCCL on GPU), shard the model with `fully_shard` (one unit per decoder layer,
then the root), and pull disjoint shards of every step's batch from replay.
After each optimizer step all ranks gather the adapter (`full_tensor()` is a
collective) and rank 0 publishes it as policy version v + 1. The reference
policy, when a loss needs it, is the same model with the adapter disabled.

Shutdown is deliberate: the weight publisher's thread is joined and the process
group destroyed in `close()`, otherwise gloo aborts the process at exit.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from policy.load import LoraSpec


@dataclass
class LearnerConfig:
    """The learner (FSDP ranks, LoRA, GRPO)."""

    lr: float = 1.5e-3
    """AdamW learning rate for the LoRA weights."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    groups_per_step: int = 16
    """Groups (tasks) per optimizer step, across all ranks (B)."""
    clip_low: float = 0.2
    """PPO clip ε_low: the ratio is kept above 1 − ε_low."""
    clip_high: float = 0.28
    """PPO clip ε_high (clip-higher): the ratio is kept below 1 + ε_high."""
    is_cap: float = 2.0
    """Truncation C of the importance weight min(π_old/μ, C) that corrects for stale or
    mismatched behaviour log-probs; 0 turns the correction off."""
    aggregation: str = "seq_mean_token_mean"
    """Loss aggregation: "seq_mean_token_mean" (each trajectory weighs the same, as in the GRPO
    paper) or "token_mean" (each token weighs the same, as in DAPO)."""
    normalize_std: bool = True
    """Divide advantages by the group's reward std (GRPO); off gives Dr.GRPO."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    micro_batch: int = 64
    """Trajectories per forward/backward pass on a rank (gradient accumulation above it)."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    device: str = "auto"
    """"cpu", "cuda" or "auto" (cuda when available)."""
    threads: int = 1
    """Torch CPU threads per learner process."""
    save_every: int = 0
    """Save the adapter under --logdir every this many steps (0 = only at the end)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"--learner.lr must be positive, got {self.lr}")
        if self.groups_per_step < 1:
            raise ValueError(f"--learner.groups-per-step must be at least 1, got {self.groups_per_step}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("--learner.clip-low must be in [0, 1) and --learner.clip-high ≥ 0")
        if self.micro_batch < 1:
            raise ValueError(f"--learner.micro-batch must be at least 1, got {self.micro_batch}")
        from learner.losses import AGGREGATIONS

        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"--learner.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--learner.device must be auto, cpu or cuda, got {self.device!r}")


class Learner:
    """One FSDP rank.

    Usage (every rank, each in its own process)::

        learner = Learner(cfg, model_path, rank, world, "tcp://127.0.0.1:29500", replay)
        endpoints = learner.setup()     # rank 0: the weight channel's endpoints
        for _ in range(steps):
            metrics = learner.step()
        learner.save(logdir / "adapter")
        learner.close()
    """

    def __init__(self, cfg: LearnerConfig, model_path: str, rank: int, world: int, dist_url: str,
                 replay, temperature: float = 1.0, host: str = "127.0.0.1", key: bytes | None = None) -> None:
        self.cfg, self.model_path, self.rank, self.world = cfg, model_path, rank, world
        self.dist_url, self.replay, self.temperature, self.host = dist_url, replay, temperature, host
        self.key = key
        self.version = 0
        self.publisher = None
        self.metrics: list[dict] = []
        self._lock = threading.Lock()

    # -- setup ----------------------------------------------------------------
    def setup(self):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from policy.load import load_model, with_lora

        torch.set_num_threads(self.cfg.threads)
        cuda = self.cfg.device == "cuda" or (self.cfg.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda", self._local_rank()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=self.dist_url,
                                rank=self.rank, world_size=self.world)
        mesh = init_device_mesh(self.device.type, (self.world,))
        base = load_model(self.model_path, device=str(self.device))
        self.pad_id = base.config.pad_token_id or 0
        model = with_lora(base, self.cfg.lora)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        if self.rank == 0:
            from replay.weights import WeightPublisher

            self.publisher = WeightPublisher(self.host, key=self.key)
        self._publish()  # version 0: the identity adapter, so late joiners can ask for it
        return self.publisher.endpoints if self.publisher else None

    def _local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank))

    # -- one step ---------------------------------------------------------------
    def step(self) -> dict:
        import torch
        import torch.distributed as dist

        from learner.batch import collate
        from learner.losses import policy_loss, token_logprobs

        t0 = time.perf_counter()
        step = self.version
        groups = self.replay.sample(step, self.rank, self.version)
        t1 = time.perf_counter()
        batch = collate(groups, self.version, self.pad_id, self.cfg.normalize_std)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Trajectories with zero advantage (their group's rewards were all equal) add nothing
        # to the gradient: skip their forward pass. Every rank still runs at least one
        # micro-batch, since FSDP's collectives need all ranks.
        live = (batch.advantages.abs() > 1e-8).nonzero().flatten().tolist() or [0]
        live.sort(key=lambda i: int(batch.attention[i].sum()))  # similar lengths share a micro-batch
        size = self.cfg.micro_batch
        chunks = [live[i:i + size] for i in range(0, len(live), size)]
        weights = self._weights(batch, chunks)
        # FSDP's collectives run once per forward/backward, so every rank must run as many
        # micro-batches as the busiest one; the extra ones carry zero weight.
        count = torch.tensor([len(chunks)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(chunks) < int(count):
            chunks.append(chunks[0][:1])
            weights.append(0.0)
        parts: dict[str, float] = {}
        for chunk, share in zip(chunks, weights):
            rows = torch.tensor(chunk)
            width = int(batch.attention[rows].sum(1).max())
            tokens = batch.tokens[rows, :width].to(self.device)
            logits = self.model(input_ids=tokens, attention_mask=batch.attention[rows, :width].to(self.device)).logits
            logp = token_logprobs(logits, tokens, self.temperature)  # [b, T]
            mask = batch.mask[rows, :width].to(self.device)
            advantages = batch.advantages[rows].to(self.device)
            if share == 0.0 or not (advantages.abs() > 1e-8).any():
                mask = mask * 0  # a padding micro-batch: it takes part in the collectives only
            loss, m = policy_loss(logp, logp.detach(), batch.behaviour[rows, :width].to(self.device),
                                  advantages, mask, self.cfg.clip_low, self.cfg.clip_high, self.cfg.is_cap,
                                  self.cfg.aggregation)
            (loss * share).backward()
            for k, v in m.items():
                parts[k] = parts.get(k, 0.0) + v * share if k != "is_weight_max" else max(parts.get(k, 0.0), v)
        total_share = sum(weights) or 1.0
        parts = {k: (v if k == "is_weight_max" else v / total_share) for k, v in parts.items()}
        parts["loss"] *= total_share  # the loss itself is over the whole batch, as optimized
        parts["trained_fraction"] = len(live) / batch.tokens.shape[0]
        n = batch.tokens.shape[0]
        n_tokens = float(batch.mask.sum())
        grad_norm = 0.0
        if self.cfg.max_grad_norm > 0:
            params = [p for p in self.model.parameters() if p.requires_grad]
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        t2 = time.perf_counter()
        self.version += 1
        adapter_bytes = self._publish()
        self.replay.ack(step, self.rank)  # trained on: replay may forget these groups
        t3 = time.perf_counter()
        local = {
            **parts, "grad_norm": grad_norm,
            "reward_mean": float(batch.rewards.mean()),
            "staleness_mean": float(batch.staleness.mean()),
            "staleness_max": float(batch.staleness.max()),
            "tokens": n_tokens, "trajectories": float(n),
            "seq_len_mean": float(batch.attention.sum(1).float().mean()),
            "wait_s": t1 - t0, "train_s": t2 - t1, "publish_s": t3 - t2,
        }
        keys = sorted(local)
        vec = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(vec)
        out = {k: float(v) / self.world for k, v in zip(keys, vec.tolist())}
        for k in ("tokens", "trajectories"):
            out[k] *= self.world  # totals, not means
        out.update(step=self.version, version=self.version, adapter_bytes=adapter_bytes,
                   idle_fraction=out["wait_s"] / max(t3 - t0, 1e-9), time=time.time())
        with self._lock:
            self.metrics.append(out)
        return out

    def _weights(self, batch, chunks: list[list[int]]) -> list[float]:
        """Each micro-batch's share of the rank's loss, so that accumulation equals one big batch
        (tokens for token_mean, trajectories for seq_mean_token_mean), over all B trajectories."""
        if self.cfg.aggregation == "token_mean":
            total = float(batch.mask.sum()) or 1.0
            return [float(batch.mask[c].sum()) / total for c in chunks]
        return [len(c) / batch.tokens.shape[0] for c in chunks]

    def _adapter_tensors(self) -> dict:
        """The full adapter on every rank (all ranks must call: gathering is collective)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model)
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in state.items()}

    def _publish(self) -> int:
        from replay.weights import Adapter

        tensors = self._adapter_tensors()
        if self.publisher is None:
            return 0
        return self.publisher.publish(Adapter(self.version, self.model_path, self.cfg.lora.to_dict(), tensors))

    # -- driving ----------------------------------------------------------------
    def run(self, steps: int, stop: threading.Event | None = None, save_dir=None) -> int:
        """Train until `steps` optimizer steps in total (or fewer, see `limit`) or `stop`;
        returns the final version."""
        self.target = min(steps, getattr(self, "target", steps))
        while self.version < self.target and not (stop and stop.is_set()):
            self.step()
            if save_dir is not None and self.cfg.save_every and self.version % self.cfg.save_every == 0:
                self.save_to(save_dir)
        return self.version

    def limit(self, steps: int) -> None:
        """End training at `steps` at the latest. Every rank must get the same number, larger
        than any rank's current version, so that all stop after the same step."""
        self.target = min(steps, getattr(self, "target", steps))

    def drain_metrics(self) -> list[dict]:
        with self._lock:
            out, self.metrics = self.metrics, []
        return out

    def save_to(self, path) -> None:
        """Write the adapter in PEFT format (rank 0 writes; every rank must call)."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        tensors = self._adapter_tensors()
        if self.rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = self.model.peft_config["default"].to_dict()
        config["base_model_name_or_path"] = self.model_path
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
        (path / "tandem.json").write_text(json.dumps({"version": self.version}))

    def close(self) -> None:
        import torch.distributed as dist

        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
