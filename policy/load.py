"""Loading a policy: built-in tiny model or any Hugging Face causal LM.

`--model` takes a local path, a Hugging Face id, or `builtin:tiny` (the
randomly initialised tiny model, built into the cache on first use) /
`builtin:maze` (the tiny model after the supervised maze warm start; the
launcher builds it into the cache with launch/warmstart.py, since training it
takes the actors' and the learner's code). Nothing is downloaded for the
built-ins; policy/cache.py has the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policy.cache import build_once, cache_dir, is_built

BUILTIN_DIRS = {"builtin:tiny": "tiny-v1", "builtin:maze": "maze-sft-v2"}
"""Each built-in's directory under `cache_dir()`. A new name whenever what is built changes, so
that an old cache entry is never taken for the new one."""

BUILTIN = tuple(BUILTIN_DIRS)


def resolve_model(name: str) -> str:
    """Turn `--model` into something `from_pretrained` accepts, building `builtin:tiny` if needed."""
    if name == "builtin:tiny":
        from policy.tiny import save_tiny

        return str(build_once(cache_dir() / BUILTIN_DIRS[name], save_tiny))
    if name == "builtin:maze":
        path = cache_dir() / BUILTIN_DIRS[name]
        if not is_built(path):
            raise FileNotFoundError(
                f"the maze warm start is not built yet at {path}; the launcher builds it "
                "(python -m launch.warmstart)")
        return str(path)
    if name.startswith("builtin:"):
        raise ValueError(f"unknown built-in model {name!r}; choose one of {BUILTIN}")
    return name


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: str, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device)


@dataclass
class LoraSpec:
    """The LoRA adapter trained by the learner and applied by the actors."""

    rank: int = 32
    """LoRA rank r."""
    alpha: float = 64.0
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters; "all-linear" means every linear layer but the output head."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--learner.lora.rank must be at least 1, got {self.rank}")

    def peft_config(self):
        from peft import LoraConfig

        targets = self.target_modules
        return LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0, bias="none",
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            task_type="CAUSAL_LM")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


def with_lora(model, spec: LoraSpec):
    """Wrap `model` with a fresh (identity) LoRA adapter."""
    from peft import get_peft_model

    return get_peft_model(model, spec.peft_config())
