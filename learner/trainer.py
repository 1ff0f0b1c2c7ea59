"""The learner: FSDP2 over N ranks training a LoRA policy (GRPO, RLOO or PPO with a critic).

Each rank is one process. Ranks join one torch.distributed group (gloo on CPU,
NCCL on GPU), shard the model with `fully_shard` (one unit per decoder layer,
then the root; learner/model.py builds it on the meta device, fills each rank's
shards from rank 0, and sets bf16 mixed precision), and pull disjoint shards of every step's batch from replay.
After each optimizer step all ranks gather the adapter (`full_tensor()` is a
collective) and rank 0 publishes it as policy version v + 1. The reference
policy, when a loss needs it, is the same model with the adapter disabled
(PEFT's `disable_adapter()`), so there is no second copy in memory.

A step (`step`): sample the batch; compute start-of-step quantities (π_old when
there are several mini-batches, V_old and GAE advantages for PPO) without grad;
for each mini-batch accumulate micro-batch gradients and take one optimizer step;
publish; reduce the metrics across ranks. Which rows, which shares and which
reductions is learner/plan.py; the forward passes are learner/forward.py; the loss
is learner/objective.py over the pure functions of learner/losses.py.

PPO's critic is a second LoRA adapter ("critic") on the same frozen base plus a
linear value head on the last hidden state, its own FSDP unit. The critic's
forward routes the LoRA layers through its adapter; only the policy adapter
("default") is gathered and published. Policy and critic gradients are clipped
separately, so a large value loss cannot shrink the policy's step.

The learner is handed its weight publisher (weights/publisher.py's `Publisher`: rank 0
has one, other ranks None) as it is handed its replay client; whoever built either closes
it. Shutdown is deliberate: the process group is destroyed in `close()`, otherwise gloo
aborts the process at exit.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from learner.config import (ALGOS, CORRECTIONS, CRITIC, DEFAULT_ALGO, DEFAULT_CORRECTION, POLICY, LearnerConfig,
                            lr_factor)
from learner.colocate import restore_reshard_after_forward
from learner.forward import Forward
from policy.adapter import Adapter
from policy.choices import check_choice

if TYPE_CHECKING:
    from weights.publisher import Publisher


class Learner(Forward):
    """One FSDP rank (its forward passes over a batch: learner/forward.py).

    Usage (every rank, each in its own process)::

        learner = Learner(cfg, model_path, rank, world, "tcp://127.0.0.1:29500", replay, algo="ppo",
                          horizon=steps, publisher=publisher if rank == 0 else None)
        learner.setup()                 # publishes the current adapter (version 0 on a fresh run)
        for _ in range(steps):
            metrics = learner.step()    # or learner.run(steps)
        learner.save_to(logdir / "adapter")
        learner.close()
    """

    def __init__(self, cfg: LearnerConfig, model_path: str, rank: int, world: int, dist_url: str,
                 replay, temperature: float = 1.0, algo: str = DEFAULT_ALGO,
                 correction: str = DEFAULT_CORRECTION, horizon: int | None = None, checkpoints=None,
                 publisher: Publisher | None = None, base_config=None) -> None:
        check_choice("--algo", algo, ALGOS)  # a learner built in code has no root config to check these
        check_choice("--correction", correction, CORRECTIONS)
        self.cfg, self.model_path, self.rank, self.world = cfg, model_path, rank, world
        self.dist_url, self.replay, self.temperature = dist_url, replay, temperature
        self.algo, self.correction = algo, correction
        self.version = 0
        """Adapters published so far: the policy version of the current weights."""
        self.steps_done = 0
        """Optimizer steps in the current weights (the budget and the schedule count these); equal
        to `version` unless the group went back to a checkpoint (learner/checkpoint.py)."""
        self.checkpoints = checkpoints
        """A learner.checkpoint.Checkpoints of the run directory, or None (no checkpoints)."""
        self.before_step = None
        """Called before each step of `run` on every rank (colocated mode: generate the step's
        groups, launch/colocate.py); its seconds are the step's `generate_s`."""
        self._generate_s = None
        self.published = None
        """The snapshot of the current version `_publish` took on this rank (read it, never change it:
        the weight channel sends from its memory)."""
        self.base_config = base_config
        """A transformers config to build a randomly initialised base of that shape from, instead of
        loading `model_path`'s weights (benchmarks of model sizes without a checkpoint); None normally."""
        if horizon is not None and horizon < 1:
            raise ValueError(f"the learning-rate schedule's horizon must be at least 1 step, got {horizon}")
        self._horizon = horizon
        self.publisher = publisher
        """Where adapters are published (weights/publisher.py), or None (ranks other than 0)."""
        self.value_head = None
        self.metrics: list[dict] = []
        self._lock = threading.Lock()

    @property
    def horizon(self) -> int | None:
        """Optimizer steps the learning-rate schedule spans: the constructor's `horizon`, else the
        budget of the first `run` (not a time-limited end); None, a constant rate, for a learner
        driven by `step` alone without one."""
        return self._horizon

    # -- setup ----------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Join the process group, load and shard the model, publish the current adapter. With
        `resume`, the newest checkpoint of
        `checkpoints` (if any) is loaded first, and versions go on from the run's highest."""
        import torch
        import torch.distributed as dist
        from peft.tuners.tuners_utils import BaseTunerLayer
        from torch.distributed.device_mesh import init_device_mesh

        from learner.model import build_policy, resolve_dtype
        from policy.load import pad_id
        from policy.vision import scheme_for

        torch.set_num_threads(self.cfg.threads)
        cuda = self.cfg.device == "cuda" or (self.cfg.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda", self._local_rank()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=self.dist_url,
                                rank=self.rank, world_size=self.world)
        mesh = init_device_mesh(self.device.type, (self.world,))
        self.dtype = resolve_dtype(self.cfg.dtype, self.device)
        self.keep_gathered = self.cfg.keep_gathered == "on" or (self.cfg.keep_gathered == "auto" and not cuda)
        model, self.value_head = build_policy(
            self.base_config or self.model_path, self.cfg.lora, mesh, self.device, self.dtype,
            critic=self.algo == "ppo", checkpointing=self.cfg.activation_checkpointing,
            fused=self.cfg.fused_lora)
        self.pad_id = pad_id(model.config)
        self.model = model
        self.scheme = None if self.base_config is not None else scheme_for(self.model_path)
        self._lora_layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.policy_params = [p for n, p in named if f".{CRITIC}." not in n]
        self.critic_params = [p for n, p in named if f".{CRITIC}." in n]
        groups = [{"params": self.policy_params, "lr": self.cfg.lr, "base_lr": self.cfg.lr}]
        if self.value_head is not None:
            self.critic_params += list(self.value_head.parameters())
            groups.append({"params": self.critic_params, "lr": self.cfg.critic_lr, "base_lr": self.cfg.critic_lr})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=self.cfg.weight_decay)
        if resume:
            self._resume()
        self._publish()  # the current adapter (version 0: the identity), so late joiners can ask for it

    def _resume(self) -> None:
        """Load the newest checkpoint; the version goes on from the highest the run published
        (learner/checkpoint.py). Without a checkpoint the weights are fresh, at step 0."""
        from learner.checkpoint import resume_version

        if self.checkpoints is None:
            raise ValueError("resuming needs the run directory's checkpoints")
        path = self.checkpoints.latest()
        meta = self.checkpoints.load(self, path) if path is not None else {"step": 0, "version": 0}
        self.steps_done = int(meta["step"])
        self.version = resume_version(int(meta["version"]), self.checkpoints.highest_version())

    def state_dicts(self) -> tuple[dict, dict]:
        """(trainable parameters, optimizer state) as torch.distributed.checkpoint saves them:
        sharded, frozen base weights left out."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self._trainable(), self.optimizer, options=StateDictOptions(ignore_frozen_params=True))

    def load_state_dicts(self, model_state: dict, optim_state: dict) -> None:
        """Put what `state_dicts` gave (filled by torch.distributed.checkpoint's load, which refuses
        a checkpoint that lacks any of its keys) into the model and the optimizer. strict=False
        because the frozen base weights are left out on purpose."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self._trainable(), self.optimizer, model_state_dict=model_state,
                       optim_state_dict=optim_state, options=StateDictOptions(ignore_frozen_params=True, strict=False))

    def _trainable(self):
        """One module holding everything trained: the PEFT model, and PPO's value head beside it."""
        import torch

        if self.value_head is None:
            return self.model
        return torch.nn.ModuleDict({"model": self.model, "value_head": self.value_head})

    def _local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank))

    # -- one step ---------------------------------------------------------------
    def step(self) -> dict:
        """Sample the batch, compute the start-of-step quantities, take one optimizer step per
        mini-batch, publish version v + 1; returns the step's metrics, the same on every rank."""
        from learner.plan import StepSums, step_metrics, trained_rows

        t0 = time.perf_counter()
        batch, group_ids = self._sample()
        t1 = time.perf_counter()
        self.model.train()
        live, minis = trained_rows(batch, self.algo == "ppo", self.cfg.mini_batches)
        start = self._start_of_step(batch, live)
        factor = self._set_lr(self.steps_done)
        sums = StepSums()
        for mini in minis:
            self._update(batch, mini, start, sums)
        t2 = time.perf_counter()
        # Trained on: replay forgets these groups for good, before the adapter that holds them is
        # published (a learner group that went back to a checkpoint never gets them again).
        self.replay.ack(self.version, self.rank)
        self.steps_done += 1
        self.version += 1
        if self.checkpoints is not None:
            self.checkpoints.record_trained(self.rank, self.steps_done, self.version, group_ids)
        adapter_bytes = self._publish()
        t3 = time.perf_counter()
        local = step_metrics(batch, live, sums, self.cfg.mini_batches)
        # idle: each rank's own share of its step spent waiting for the batch, averaged over ranks
        local.update(lr=self.cfg.lr * factor, wait_s=t1 - t0, train_s=t2 - t1, publish_s=t3 - t2,
                     idle_fraction=(t1 - t0) / max(t3 - t0, 1e-9))
        if self._generate_s is not None:
            local["generate_s"], self._generate_s = self._generate_s, None
        out = self._reduce(local)
        out.update(step=self.steps_done, version=self.version, adapter_bytes=adapter_bytes,
                   time=time.time())
        if getattr(self, "_checkpoint_s", None) is not None:
            out["checkpoint_s"], self._checkpoint_s = self._checkpoint_s, None
        with self._lock:
            self.metrics.append(out)
        return out

    def _sample(self):
        """This rank's shard of the step's batch from replay (asked for by the version it starts
        from: unique across faults), collated with the group advantages; and the groups' ids."""
        from learner.batch import collate

        groups = self.replay.sample(self.version, self.rank, self.version)
        batch = collate(groups, self.version, self.pad_id, self.cfg.normalize_std, self.algo,
                        self.cfg.step_weight, self.cfg.step_gamma)
        return batch, [g.group_id for g in groups]

    def _start_of_step(self, batch, rows: list[int]) -> StartOfStep:
        """What stays fixed through the step's mini-batches, computed without grad over `rows`."""
        from learner.losses import gae, terminal_rewards, whiten
        from learner.plan import StartOfStep

        cfg = self.cfg
        old = None  # with one mini-batch π_old is π_θ detached: no extra pass
        if cfg.mini_batches > 1 and self.correction != "none":
            old = self._forward_all(batch, rows, self._old_logprobs)
        if self.algo != "ppo":
            return StartOfStep(old, batch.advantages)
        old_values = self._forward_all(batch, rows, self._values)  # [B, T]
        advantages, returns = gae(terminal_rewards(batch.rewards, batch.mask), old_values, batch.mask,
                                  cfg.gamma, cfg.lam)  # [B, T]
        if cfg.whiten_advantages:
            advantages = whiten(advantages, batch.mask)
        return StartOfStep(old, advantages, old_values, returns)

    def _set_lr(self, step: int) -> float:
        """Set the schedule's learning rate of optimizer step `step`; returns it as a fraction of the base."""
        factor = lr_factor(self.cfg.lr_schedule, step, self.horizon, self.cfg.lr_final)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        return factor

    def _update(self, batch, mini: list[int], start: StartOfStep, sums) -> None:
        """One optimizer step on the rows `mini`: gradients accumulated over its micro-batches,
        clipped; the micro-batches' losses and metrics go into `sums` (a plan.StepSums)."""
        self.optimizer.zero_grad(set_to_none=True)
        plan = self._plan(batch, mini)  # as many micro-batches on every rank: `last` is the same on all
        for k, (chunk, share) in enumerate(plan):
            self._accumulate(last=k == len(plan) - 1)
            loss, metrics = self._micro_batch(batch, chunk, share, start)
            sums.add(loss, metrics, share)
        self._accumulated()
        sums.norms.append(self._clip(self.policy_params))
        if self.algo == "ppo":
            sums.critic_norms.append(self._clip(self.critic_params))
        self.optimizer.step()

    def _fsdp_roots(self) -> list:
        """The FSDP roots a micro-batch runs: the policy and PPO's value head (its own root)."""
        from torch.distributed.fsdp import FSDPModule

        return [m for m in (self.model, self.value_head) if isinstance(m, FSDPModule)]

    def _accumulate(self, last: bool) -> None:
        """Before each micro-batch of an update with --learner.keep-gathered: every unit keeps its
        gathered parameters through forward and backward, and reduces its gradients and reshards
        only in the update's `last` backward (until then gradients accumulate unreduced)."""
        if not self.keep_gathered:
            return
        for root in self._fsdp_roots():
            root.set_requires_gradient_sync(last)
            root.set_reshard_after_backward(last)
            root.set_reshard_after_forward(False)

    def _accumulated(self) -> None:
        """After an update with --learner.keep-gathered: FSDP's own settings back (every unit
        resharded after forward but the roots, as fully_shard sets them). The last backward has
        resharded every unit, also those no gradient reaches (the frozen vision layers): FSDP's
        end-of-backward callback reshards them."""
        if not self.keep_gathered:
            return
        for root in self._fsdp_roots():
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
            restore_reshard_after_forward(root)

    def _micro_batch(self, batch, chunk: list[int], share: float, start: StartOfStep) -> tuple[float, dict]:
        """Forward and backward of the rows `chunk`, the loss scaled by its `share`. Returns the
        loss (learner/objective.py; unscaled) and the micro-batch's metrics."""
        import torch

        from learner.losses import value_loss
        from learner.objective import policy_objective

        cfg, ppo = self.cfg, self.algo == "ppo"
        rows = torch.tensor(chunk)
        tokens, attention, pixels, width = self._inputs(batch, chunk)
        mask = batch.mask[rows, :width].to(self.device)
        if share == 0.0:
            mask = mask * 0  # a padding micro-batch: it takes part in the collectives only
        old = start.old[rows, :width].to(self.device) if start.old is not None else None
        adv = start.advantages[rows, :width] if start.advantages.dim() == 2 else start.advantages[rows]
        adv = adv.to(self.device)
        logp, entropy = self._policy_terms(tokens, attention, pixels, entropy=True)  # [b, T] each
        ref = self._ref_logprobs(tokens, attention, pixels) if cfg.kl_coef > 0 else None
        loss, m = policy_objective(cfg, self.correction, logp, entropy, mask,
                                   batch.behaviour[rows, :width].to(self.device), adv, old, ref)
        (loss * share).backward()
        if ppo:
            values = self._values(tokens, attention, pixels)
            vloss, vm = value_loss(values, start.old_values[rows, :width].to(self.device),
                                   start.returns[rows, :width].to(self.device), mask, cfg.value_clip,
                                   cfg.aggregation, cfg.norm_length)
            (cfg.vf_coef * vloss * share).backward()
            m.update(vm)
        return float(loss.detach()), m

    def _reduce(self, local: dict) -> dict:
        """Every rank's `local` metrics gathered and reduced by plan.reduce_metrics (sums, maxima,
        means): a collective, and every rank gets the same result."""
        import torch
        import torch.distributed as dist

        from learner.plan import reduce_metrics

        keys = sorted(local)
        vec = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(vec) for _ in range(self.world)]
        dist.all_gather(gathered, vec)
        return reduce_metrics(keys, torch.stack(gathered).cpu())

    def _clip(self, params) -> float:
        """Clip the gradient of `params` by global norm (a collective); returns the norm before."""
        import torch

        if self.cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def adapter_tensors(self, dtype: torch.dtype | None = None) -> dict:
        """A snapshot of the full policy adapter, name -> CPU tensor (cast to `dtype` if given), on
        every rank (all ranks must call: gathering is collective). Copies: on one rank
        `full_tensor()` is the parameter itself, and a snapshot must not move."""
        from peft import get_peft_model_state_dict

        # never the critic; an adapted output head tied to the embeddings: its A and B, not the frozen
        # embedding matrix (what actors/vllm_checks.py adapter_shapes expects)
        state = get_peft_model_state_dict(self.model, adapter_name=POLICY, save_embedding_layers=False)
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to("cpu", dtype, copy=True)
                for k, v in state.items()}

    def adapter(self, dtype: torch.dtype | None = None) -> Adapter:
        """A snapshot of the current policy version as the weight channel carries it (in `dtype` if
        given); every rank must call, as for `adapter_tensors`."""
        return Adapter(self.version, self.model_path, self.cfg.lora.to_dict(), self.adapter_tensors(dtype))

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype engines get the adapter in: a bf16 learner's is bf16 (half the bytes, cast in
        the snapshot's one copy, which the weight channel then sends from its own memory)."""
        import torch

        return torch.bfloat16 if self.dtype == torch.bfloat16 else None

    def _publish(self) -> int:
        adapter = self.adapter(self.wire_dtype)
        self.published = adapter  # every rank's snapshot of its current version (colocated vLLM loads it)
        if self.publisher is None:
            return 0
        size = self.publisher.publish(adapter)
        if self.checkpoints is not None:
            self.checkpoints.record_published(self.version)
        return size

    # -- driving ----------------------------------------------------------------
    def run(self, steps: int, stop: threading.Event | None = None, save_dir=None, checkpoint_every: int = 0) -> int:
        """Train until `steps` optimizer steps in total (or fewer, see `limit`) or `stop`,
        checkpointing every `checkpoint_every` steps and at the end (with `checkpoints`);
        returns the final version."""
        self.target = min(steps, getattr(self, "target", steps))
        self._horizon = self._horizon or steps
        saved = self.steps_done
        while self.steps_done < self.target and not (stop and stop.is_set()):
            if self.before_step is not None:
                t = time.perf_counter()
                self.before_step()
                self._generate_s = time.perf_counter() - t
            self.step()
            if save_dir is not None and self.cfg.save_every and self.steps_done % self.cfg.save_every == 0:
                self.save_to(save_dir)
            if self.checkpoints is not None and checkpoint_every and self.steps_done % checkpoint_every == 0:
                t = time.perf_counter()
                self.checkpoints.save(self)
                self._checkpoint_s = time.perf_counter() - t  # reported with the next step
                saved = self.steps_done
        if self.checkpoints is not None and checkpoint_every and saved != self.steps_done:
            self.checkpoints.save(self)
        return self.version

    def limit(self, steps: int) -> None:
        """End training at `steps` optimizer steps at the latest. Every rank must get the same
        number, larger than any rank's `steps_done`, so that all stop after the same step."""
        self.target = min(steps, getattr(self, "target", steps))

    def drain_metrics(self) -> list[dict]:
        with self._lock:
            out, self.metrics = self.metrics, []
        return out

    def save_to(self, path) -> None:
        """Write the adapter with its version as a directory in PEFT format (policy/adapter.py;
        rank 0 writes; every rank must call)."""
        from policy.adapter import write_adapter

        tensors = self.adapter_tensors()
        if self.rank != 0:
            return
        write_adapter(path, tensors, self.cfg.lora, self.model_path, self.version)

    def close(self, failed: bool = False) -> None:
        """Leave the process group: after a clean run all ranks meet in a barrier first. A rank that
        `failed` leaves at once, since its peers may sit in another collective (a barrier would hang
        until the watchdog, and the error would never reach the driver): on gloo it destroys the
        group, which fails the peers' collectives at once; on NCCL it leaves the group to the end of
        the process (ncclCommAbort waits on peers in some NCCL versions), which the driver ends."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if not failed:
            dist.barrier()
            dist.destroy_process_group()
        elif dist.get_backend() == "gloo":
            dist.destroy_process_group()
