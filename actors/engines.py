"""The engines by name: `--actor.engine` chooses one, and `make_engine` builds it.

vLLM is an optional extra; actors/vllm_engine.py imports it only when an engine
starts, so importing this module costs nothing without it.
"""

from __future__ import annotations

from actors.engine import Engine, RequestEngine
from actors.torch_engine import TorchEngine
from actors.vllm_engine import VLLMEngine

ENGINES = {"torch": TorchEngine, "vllm": VLLMEngine}
"""Every engine `--actor.engine` may name."""


def make_engine(kind: str, model_path: str, lora, device: str = "cpu", seed: int = 0,
                **options) -> Engine | RequestEngine:
    """The engine `kind` (a key of `ENGINES`); `options` are that engine's own keyword arguments
    (`ActorConfig.engine_options()` gives them from the config)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(map(repr, ENGINES))}")
    return ENGINES[kind](model_path, lora, device=device, seed=seed, **options)
