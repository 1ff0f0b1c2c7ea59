"""The learner: FSDP2 over N ranks training a LoRA policy (GRPO, RLOO or PPO with a critic).

Each rank is one process. Ranks join one torch.distributed group (gloo on CPU,
NCCL on GPU), shard the model with `fully_shard` (one unit per decoder layer,
then the root), and pull disjoint shards of every step's batch from replay.
After each optimizer step all ranks gather the adapter (`full_tensor()` is a
collective) and rank 0 publishes it as policy version v + 1. The reference
policy, when a loss needs it, is the same model with the adapter disabled
(PEFT's `disable_adapter()`), so there is no second copy in memory.

A step: sample the batch; compute start-of-step quantities (π_old when there are
several mini-batches, V_old and GAE advantages for PPO) without grad; then for
each mini-batch accumulate micro-batch gradients and take one optimizer step.
The losses themselves are the pure functions of learner/losses.py.

PPO's critic is a second LoRA adapter ("critic") on the same frozen base plus a
linear value head on the last hidden state, its own FSDP unit. The critic's
forward routes the LoRA layers through its adapter; only the policy adapter
("default") is gathered and published. Policy and critic gradients are clipped
separately, so a large value loss cannot shrink the policy's step.

Shutdown is deliberate: the weight publisher's thread is joined and the process
group destroyed in `close()`, otherwise gloo aborts the process at exit.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

from learner.config import LearnerConfig, lr_factor

POLICY, CRITIC = "default", "critic"
"""PEFT adapter names: the policy (published to actors) and PPO's critic (never published)."""


class Learner:
    """One FSDP rank.

    Usage (every rank, each in its own process)::

        learner = Learner(cfg, model_path, rank, world, "tcp://127.0.0.1:29500", replay, algo="ppo")
        endpoints = learner.setup()     # rank 0: the weight channel's endpoints
        for _ in range(steps):
            metrics = learner.step()
        learner.save(logdir / "adapter")
        learner.close()
    """

    def __init__(self, cfg: LearnerConfig, model_path: str, rank: int, world: int, dist_url: str,
                 replay, temperature: float = 1.0, host: str = "127.0.0.1", key: bytes | None = None,
                 algo: str = "grpo", correction: str = "tis") -> None:
        from learner.losses import ALGOS, CORRECTIONS

        if algo not in ALGOS:
            raise ValueError(f"unknown --algo {algo!r}; choose one of {', '.join(ALGOS)}")
        if correction not in CORRECTIONS:
            raise ValueError(f"unknown --correction {correction!r}; choose one of {', '.join(CORRECTIONS)}")
        self.cfg, self.model_path, self.rank, self.world = cfg, model_path, rank, world
        self.dist_url, self.replay, self.temperature, self.host = dist_url, replay, temperature, host
        self.key, self.algo, self.correction = key, algo, correction
        self.version = 0
        self.horizon: int | None = None
        """Steps the learning-rate schedule spans (set by `run` from its budget)."""
        self.publisher = None
        self.value_head = None
        self.metrics: list[dict] = []
        self._lock = threading.Lock()

    # -- setup ----------------------------------------------------------------
    def setup(self):
        import torch
        import torch.distributed as dist
        from peft.tuners.tuners_utils import BaseTunerLayer
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
        if self.algo == "ppo":
            # The critic: a second LoRA adapter on the same frozen base plus a value head. PEFT marks
            # an added adapter frozen; it is trained, so mark it trainable.
            model.add_adapter(CRITIC, self.cfg.lora.peft_config())
            model.set_requires_grad([POLICY, CRITIC], True)
            from learner.critic import ValueHead

            self.value_head = ValueHead(base.config.hidden_size, device=self.device)
            fully_shard(self.value_head, mesh=mesh)  # its own FSDP root: called outside the model's forward
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self._lora_layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.policy_params = [p for n, p in named if f".{CRITIC}." not in n]
        self.critic_params = [p for n, p in named if f".{CRITIC}." in n]
        groups = [{"params": self.policy_params, "lr": self.cfg.lr, "base_lr": self.cfg.lr}]
        if self.value_head is not None:
            self.critic_params += list(self.value_head.parameters())
            groups.append({"params": self.critic_params, "lr": self.cfg.critic_lr, "base_lr": self.cfg.critic_lr})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=self.cfg.weight_decay)
        if self.rank == 0:
            from replay.weights import WeightPublisher

            self.publisher = WeightPublisher(self.host, key=self.key)
        self._publish()  # version 0: the identity adapter, so late joiners can ask for it
        return self.publisher.endpoints if self.publisher else None

    def _local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank))

    # -- forward passes ----------------------------------------------------------
    @contextmanager
    def _adapter(self, name: str):
        """Route the LoRA layers through adapter `name`. PEFT's `set_adapter` would also freeze
        every other adapter (requires_grad=False) on each switch; this only changes the route."""
        before = [m._active_adapter for m in self._lora_layers]
        for m in self._lora_layers:
            m._active_adapter = [name]
        try:
            yield
        finally:
            for m, b in zip(self._lora_layers, before):
                m._active_adapter = b

    def _policy_logits(self, tokens, attention):
        return self.model(input_ids=tokens, attention_mask=attention).logits

    def _ref_logprobs(self, tokens, attention):
        """log π_ref: the same model with the adapter disabled (no second copy in memory)."""
        import torch

        from learner.losses import token_logprobs

        with torch.no_grad(), self.model.disable_adapter():
            logp = token_logprobs(self._policy_logits(tokens, attention), tokens, self.temperature)
        # PEFT re-enables adapters by marking only the active one trainable: restore the critic's flags.
        for p in self.critic_params:
            p.requires_grad_(True)
        return logp

    def _values(self, tokens, attention):
        """V(s_t) for the action at t, aligned like token_logprobs: [b, T] (entry 0 is 0)."""
        import torch

        with self._adapter(CRITIC):
            out = self.model(input_ids=tokens, attention_mask=attention, output_hidden_states=True)
        v = self.value_head(out.hidden_states[-1])  # [b, T]: value of the prefix ending at t
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)

    def _old_logprobs(self, tokens, attention):
        from learner.losses import token_logprobs

        return token_logprobs(self._policy_logits(tokens, attention), tokens, self.temperature)

    def _forward_all(self, batch, rows: list[int], fn):
        """`fn` over `rows` without grad, in micro-batches, into a [B, T] tensor (start-of-step
        quantities: π_old, V_old). Ranks run the same number of forward passes."""
        import torch

        out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        with torch.no_grad():
            for chunk, share in self._plan(batch, rows, shares=False):
                tokens, attention, width = self._inputs(batch, chunk)
                value = fn(tokens, attention).float().cpu()
                if share:
                    out[torch.tensor(chunk), :width] = value
        return out

    def _inputs(self, batch, chunk):
        import torch

        rows = torch.tensor(chunk)
        width = int(batch.attention[rows].sum(1).max())
        return (batch.tokens[rows, :width].to(self.device), batch.attention[rows, :width].to(self.device), width)

    def _plan(self, batch, rows: list[int], shares: bool = True) -> list[tuple[list[int], float]]:
        """Micro-batches of `rows` with each one's share of the rank's loss, so that accumulation
        equals one big batch (tokens for token_mean, trajectories otherwise, over all B
        trajectories of the rank, times the mini-batch count so every update is full scale).
        FSDP's collectives run once per forward/backward, so every rank runs as many
        micro-batches as the busiest one; the extra ones repeat a row with share 0."""
        import torch
        import torch.distributed as dist

        size = self.cfg.micro_batch
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        scale = self.cfg.mini_batches
        if not shares:
            weights = [1.0] * len(chunks)
        elif self.cfg.aggregation == "token_mean":
            total = float(batch.mask.sum()) or 1.0
            weights = [scale * float(batch.mask[c].sum()) / total for c in chunks]
        else:
            weights = [scale * len(c) / batch.tokens.shape[0] for c in chunks]
        count = torch.tensor([len(chunks)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(chunks) < max(int(count), 1):  # at least one: every rank reports the same metrics
            chunks.append((rows or [0])[:1])
            weights.append(0.0)
        return list(zip(chunks, weights))

    # -- one step ---------------------------------------------------------------
    def step(self) -> dict:
        import torch
        import torch.distributed as dist

        from learner.batch import collate
        from learner.losses import (aggregate, correct, gae, kl_penalty, mismatch_kl, policy_loss, terminal_rewards,
                                    token_entropy, token_logprobs, value_loss, whiten)

        cfg, ppo = self.cfg, self.algo == "ppo"
        t0 = time.perf_counter()
        step = self.version
        groups = self.replay.sample(step, self.rank, self.version)
        t1 = time.perf_counter()
        batch = collate(groups, self.version, self.pad_id, cfg.normalize_std, self.algo)
        self.model.train()
        n = batch.tokens.shape[0]
        # Trajectories with zero advantage (their group's rewards were all equal) add nothing to a
        # critic-free gradient: skip their forward pass. PPO's critic learns from every trajectory.
        keep = batch.mask.sum(1) > 0 if ppo else batch.advantages.abs() > 1e-8
        live = keep.nonzero().flatten().tolist()
        live.sort(key=lambda i: int(batch.attention[i].sum()))  # similar lengths share a micro-batch
        minis = [live[k::cfg.mini_batches] for k in range(cfg.mini_batches)]  # each spans all lengths

        # Start-of-step quantities. With one mini-batch π_old is π_θ detached (no extra pass).
        old = None
        if cfg.mini_batches > 1 and self.correction != "none":
            old = self._forward_all(batch, live, self._old_logprobs)
        advantages = batch.advantages  # [B]
        if ppo:
            old_values = self._forward_all(batch, live, self._values)  # [B, T]
            advantages, returns = gae(terminal_rewards(batch.rewards, batch.mask), old_values, batch.mask,
                                      cfg.gamma, cfg.lam)  # [B, T]
            if cfg.whiten_advantages:
                advantages = whiten(advantages, batch.mask)

        factor = lr_factor(cfg.lr_schedule, step, self.horizon, cfg.lr_final)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        sums: dict[str, float] = {}
        total_share, is_max, loss_total = 0.0, 0.0, 0.0
        norms, critic_norms = [], []
        for mini in minis:
            self.optimizer.zero_grad(set_to_none=True)
            for chunk, share in self._plan(batch, mini):
                rows = torch.tensor(chunk)
                tokens, attention, width = self._inputs(batch, chunk)
                mask = batch.mask[rows, :width].to(self.device)
                if share == 0.0:
                    mask = mask * 0  # a padding micro-batch: it takes part in the collectives only
                mu = batch.behaviour[rows, :width].to(self.device)
                logits = self._policy_logits(tokens, attention)
                logp = token_logprobs(logits, tokens, self.temperature)  # [b, T]
                old_lp = old[rows, :width].to(self.device) if old is not None else logp.detach()
                corr = correct(self.correction, old_lp, mu, mask, cfg.is_cap, cfg.geo_bound, cfg.drop_cap)
                adv = advantages[rows].to(self.device) if not ppo else advantages[rows, :width].to(self.device)
                loss, m = policy_loss(logp, corr, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                      cfg.aggregation, cfg.norm_length, cfg.behaviour_clip)
                with torch.set_grad_enabled(cfg.entropy_coef > 0):  # a metric only: no graph over [b, T, V]
                    entropy = aggregate(token_entropy(logits, self.temperature), mask, cfg.aggregation,
                                        cfg.norm_length)
                if cfg.entropy_coef > 0:
                    loss = loss - cfg.entropy_coef * entropy
                if cfg.kl_coef > 0:
                    kl = aggregate(kl_penalty(logp, self._ref_logprobs(tokens, attention), cfg.kl_estimator),
                                   mask, cfg.aggregation, cfg.norm_length)
                    loss = loss + cfg.kl_coef * kl
                    m["kl_ref"] = float(kl.detach())
                m["entropy"] = float(entropy.detach())
                m["mismatch_kl"] = mismatch_kl(old_lp, mu, mask)
                m["masked_fraction"] = float(1.0 - corr.mask.sum() / mask.sum().clamp(min=1.0))
                (loss * share).backward()
                if ppo:
                    values = self._values(tokens, attention)
                    vloss, vm = value_loss(values, old_values[rows, :width].to(self.device),
                                           returns[rows, :width].to(self.device), mask, cfg.value_clip,
                                           cfg.aggregation, cfg.norm_length)
                    (cfg.vf_coef * vloss * share).backward()
                    m.update(vm)
                loss_total += float(loss.detach()) * share
                total_share += share
                is_max = max(is_max, m.pop("is_weight_max"))
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v * share
            norms.append(self._clip(self.policy_params))
            if ppo:
                critic_norms.append(self._clip(self.critic_params))
            self.optimizer.step()
        t2 = time.perf_counter()
        self.version += 1
        adapter_bytes = self._publish()
        self.replay.ack(step, self.rank, wait=False)  # trained on: replay may forget these groups
        t3 = time.perf_counter()
        parts = {k: v / (total_share or 1.0) for k, v in sums.items()}
        local = {
            **parts, "loss": loss_total / cfg.mini_batches, "is_weight_max": is_max,
            "grad_norm": sum(norms) / len(norms), "trained_fraction": len(live) / n,
            "reward_mean": float(batch.rewards.mean()),
            "staleness_mean": float(batch.staleness.mean()),
            "staleness_max": float(batch.staleness.max()),
            "tokens": float(batch.mask.sum()), "trajectories": float(n),
            "seq_len_mean": float(batch.attention.sum(1).float().mean()),
            "wait_s": t1 - t0, "train_s": t2 - t1, "publish_s": t3 - t2, "lr": cfg.lr * factor,
        }
        if ppo:
            local["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
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

    def _clip(self, params) -> float:
        """Clip the gradient of `params` by global norm (a collective); returns the norm before."""
        import torch

        if self.cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _adapter_tensors(self) -> dict:
        """A snapshot of the full adapter on every rank (all ranks must call: gathering is collective).
        Copies: on one rank `full_tensor()` is the parameter itself, and a snapshot must not move."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, adapter_name=POLICY)  # never the critic
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                for k, v in state.items()}

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
        self.horizon = self.horizon or steps  # the schedule spans the budget, not a time-limited end
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
