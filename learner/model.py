"""The learner's policy as FSDP2 shards: built on the meta device, filled from rank 0.

No rank ever holds the whole model on its device. Every rank builds the model's skeleton with
its parameters on the meta device (no memory), adds the LoRA adapters, shards it with
`fully_shard` (one unit per decoder layer, then the root), and only then allocates its own
shards (`to_empty`). Rank 0 loads the checkpoint on CPU (`from_pretrained`, so every key
renaming and weight tying transformers knows is applied) with the LoRA adapters PEFT makes, and
`set_model_state_dict(..., broadcast_from_rank0=True)` sends it one tensor at a time; each rank
keeps its shard. So the LoRA initialisation is PEFT's own (A Kaiming-uniform, B zero: the
identity), drawn on rank 0 from the caller's seed without consuming it (`fork_rng`), the same as
a plain `with_lora(load_model(...))`; and every rank trains the same adapter.

Buffers are not in a state dict when they are not persistent (rotary `inv_freq`, …), and
`to_empty` leaves garbage in them. The skeleton is therefore built with only its *parameters*
on the meta device (`_parameters_on_meta`, the technique of accelerate's
`init_empty_weights(include_buffers=False)`): the constructors compute the buffers as usual,
on CPU; they are kept aside and copied back after `to_empty`.

Mixed precision (`dtype="bfloat16"`): frozen base weights are stored in bf16; LoRA weights (and
PPO's critic adapter and value head) stay fp32 (PEFT's `autocast_adapter_dtype` upcasts them),
so the optimizer's state is fp32. FSDP2's `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` all-gathers every parameter as bf16 for compute and reduce-scatters
gradients in fp32 into the fp32 shards. FSDP2 requires one original dtype among the
*trainable* parameters of a unit (`FSDPParamGroup._init_mp_dtypes`); the frozen bf16 weights
are not counted, and with param_dtype bf16 every all-gather input is bf16, so mixing the two in
a unit is within its rules. Losses and log-probs are computed in fp32 from the bf16 outputs
(learner/losses.py calls `.float()`).

Activation checkpointing uses transformers' `gradient_checkpointing_enable(use_reentrant=False)`:
it checkpoints each decoder layer without renaming modules (a `checkpoint_wrapper` would add
`_checkpoint_wrapped_module.` to every name, and with it to the published adapter's keys), and
non-reentrant checkpointing gives the LoRA weights their gradients without inputs that require
grad. FSDP2 re-gathers a layer's parameters when its forward is replayed in the backward.

Fused LoRA (`fuse_lora`, --learner.fused-lora): PEFT computes a LoRA layer as W·x + s·B·(A·x),
two thin products, a scale and a sum in the forward and as many again in the backward. Where the
adapter is not thin next to W (r·(in+out) ≥ in·out/3: every layer of the built-in models at rank
32, none of a 0.5B model's) those extra kernels cost more than the one they save: the layer is
then computed as one linear map with W' = W + s·B·A, built at each forward (autograd takes the
gradients of A and B through the product: s·dW'·Aᵀ and s·Bᵀ·dW', dW' = dyᵀ·x). The same values
and gradients up to float summation order; only in float32 compute (in bfloat16 W' would round
the adapter's update against W's magnitude). The module tree, the names and the saved adapter are
PEFT's own; a layer whose adapters are disabled, merged, mixed or more than one at a time takes
PEFT's forward.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from learner.config import CRITIC, DTYPES, POLICY
from policy.choices import check_choice
from policy.load import LoraSpec


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The learner's base-weight and compute dtype: "auto" is bf16 on CUDA, fp32 on CPU."""
    check_choice("--learner.dtype", name, DTYPES)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@contextmanager
def _parameters_on_meta():
    """Parameters registered inside go to the meta device; buffers stay where they were made."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":  # already meta: a tied weight, kept shared
            made = module._parameters[name]
            module._parameters[name] = type(made)(made.to("meta"), requires_grad=made.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _add_adapters(base, lora: LoraSpec | None, critic: bool):
    from policy.load import with_lora

    if lora is None:  # the base alone: adapters come later (serve/trainer.py adds one per client)
        return base
    model = with_lora(base, lora)
    if critic:
        # PEFT marks an added adapter frozen; the critic is trained, so mark it trainable.
        model.add_adapter(CRITIC, lora.peft_config())
        model.set_requires_grad([POLICY, CRITIC], True)
    return model


def decoder_layers(model) -> list:
    """The transformer layers of a model, PEFT-wrapped or not, each of which becomes one FSDP
    unit: a causal LM's decoder layers; a vision-language model's decoder layers and its vision
    tower's (Idefics3's `layers`, Qwen-VL's `blocks`)."""
    from peft import PeftModel

    inner = model.base_model.model if isinstance(model, PeftModel) else model
    return [layer for name, stack in inner.named_modules()
            if isinstance(stack, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "blocks")
            for layer in stack]


def _fusable(layer) -> bool:
    """Whether a PEFT LoRA layer is worth computing fused (module docstring): a plain linear base,
    plain LoRA (no dropout, no variant such as DoRA) and r·(in+out) ≥ in·out/3."""
    base = layer.base_layer
    if not isinstance(base, torch.nn.Linear) or getattr(layer, "fan_in_fan_out", False) or layer.lora_variant:
        return False
    if any(not isinstance(d, torch.nn.Identity) for d in layer.lora_dropout.values()) or not layer.r:
        return False
    return 3 * max(layer.r.values()) * (base.in_features + base.out_features) >= base.in_features * base.out_features


def _fused_forward(self, x, *args, **kwargs):
    """A LoRA layer's forward as one linear map, W + s·B·A (module docstring); PEFT's own forward
    for anything but one active plain adapter."""
    active = self.active_adapters
    if args or kwargs or self.disable_adapters or self.merged or len(active) != 1 or active[0] not in self.lora_A:
        return type(self).forward(self, x, *args, **kwargs)
    name, base = active[0], self.base_layer
    weight = torch.addmm(base.weight, self.lora_B[name].weight, self.lora_A[name].weight, alpha=self.scaling[name])
    return torch.nn.functional.linear(x, weight, base.bias)


def fuse_lora(model) -> int:
    """Compute the LoRA layers of `model` (a PEFT model) that `_fusable` admits as one linear map
    each (module docstring); returns how many. Only for float32 compute."""
    import types

    from peft.tuners.lora import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear) and _fusable(m)]
    for m in layers:
        m.forward = types.MethodType(_fused_forward, m)
    return len(layers)


def build_policy(source, lora: LoraSpec | None, mesh, device: torch.device, dtype: torch.dtype,
                 critic: bool = False, checkpointing: bool = False, fused: bool = False):
    """The PEFT policy sharded over `mesh`, and PPO's value head (None without `critic`). With
    `lora` None, the base model alone, sharded (no `critic`): adapters added to it later are plain
    tensors beside FSDP's shards, the same on every rank (serve/trainer.py).

    `source` is a model path (weights from rank 0's checkpoint) or a transformers config (a
    randomly initialised model of that shape: benchmarks of sizes without a checkpoint). Every
    rank of `mesh` must call, with the same global RNG state. `fused`: LoRA layers computed fused
    where that pays (`fuse_lora`; float32 only)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, PretrainedConfig

    from policy.attention import use_gqa_sdpa
    from policy.load import model_class

    pretrained = not isinstance(source, PretrainedConfig)
    config = AutoConfig.from_pretrained(source) if pretrained else copy.deepcopy(source)
    config.use_cache = False  # training keeps no KV cache (and checkpointed layers refuse one)
    # Drawn first, from the caller's RNG state, as a plain `with_lora(load_model(...))` would draw.
    full = _rank0_state_dict(source, lora, dtype, critic) if pretrained and dist.get_rank() == 0 else {}
    with _parameters_on_meta():
        base = model_class(config).from_config(config, dtype=dtype)
        use_gqa_sdpa(base)
        model = _add_adapters(base, lora, critic)
        if lora is None:
            base.requires_grad_(False)  # frozen before sharding: FSDP then reduces no base gradient
    if fused and lora is not None and dtype == torch.float32:
        fuse_lora(model)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    mp = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32
          else MixedPrecisionPolicy())
    value_head = None
    if critic:
        from learner.critic import ValueHead

        value_head = ValueHead(config.get_text_config().hidden_size, device=device)
        fully_shard(value_head, mesh=mesh, mp_policy=mp)  # its own FSDP root: called outside the model's forward
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    if pretrained:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        _random_init(model, getattr(config, "initializer_range", 0.02))
    return model, value_head


def _rank0_state_dict(path: str, lora: LoraSpec | None, dtype: torch.dtype, critic: bool) -> dict:
    """The full state dict of the PEFT model on CPU: the checkpoint's weights and PEFT's fresh
    adapters, drawn from the current RNG state without advancing it."""
    from policy.load import load_model

    with torch.random.fork_rng(devices=[]):
        model = _add_adapters(load_model(path, dtype=str(dtype).removeprefix("torch.")), lora, critic)
    return model.state_dict()


@torch.no_grad()
def _random_init(model, std: float) -> None:
    """Random base weights (normal(0, std); norms 1) and fresh adapters (A Kaiming-uniform as
    PEFT draws it, B zero) in each rank's local shards: for benchmarks only, so the draws are
    per shard, not those of a full tensor."""
    import math

    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if "lora_B" in name:
            local.zero_()
        elif "lora_A" in name:
            torch.nn.init.kaiming_uniform_(local, a=math.sqrt(5))
        elif p.ndim == 1:
            local.fill_(1.0)
        else:
            local.normal_(0.0, std)
