"""What an inference engine is: token ids in, sampled token ids and their log-probs out.

Two shapes of engine serve actors. A batch engine (`Engine`; the torch engine,
actors/torch_engine.py) generates a batch of turns per call; a request engine
(`RequestEngine`; the vLLM engine, an optional extra for GPUs or vLLM's CPU
build, actors/vllm_engine.py) takes one request per episode turn and answers
each as soon as it is done. `actors.engines.make_engine` builds the one that
`--actor.engine` names. This module holds what every engine shares: the
interfaces, the sampling parameters, a completion, and the seeding below.

Sampling is reproducible per request, not per batch. Which episodes share a
batch, and in which order, depends on timing (an episode whose environment call
is still running sits a turn out), so one random stream shared by the batch
would hand an episode different random numbers from run to run. A request
instead carries a seed (the rollout derives it from the episode and the turn),
and everything random about its completion is a function of that seed and the
engine's: the torch engine samples its t-th token by inverting the row's CDF at
a uniform hashed from (engine seed, request seed, t); the vLLM engine passes
vLLM a per-request seed made the same way. Unseeded requests draw from the
engine's generator, shared by the batch.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every one of `parts` and their order (any Python ints):
    the seed of a request from (episode, turn), or of a token from (engine seed, request seed,
    index). Pure: the same parts give the same seed in every process."""
    h = 0
    for part in parts:
        h = _mix64(h ^ _mix64(part & _MASK64))
    return h >> 1


def unit_uniform(seed: int) -> float:
    """A number in [0, 1) from `seed` (53 bits, as many as a float64 holds)."""
    return (_mix64(seed) >> 11) * 2.0**-53


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Sample among the k most probable tokens only; 0 (or -1) means all."""
    top_p: float = 1.0
    """Sample among the most probable tokens whose probabilities sum to top_p (nucleus); 1 means all."""

    def __post_init__(self) -> None:
        if self.top_k < -1:
            raise ValueError(f"top_k is a number of tokens (0 or -1: no limit), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    """log μ(token) under the temperature-scaled distribution the engine sampled from."""
    stopped: bool
    """True when the completion ended on a stop token (else it hit max_new_tokens)."""
    versions: list[int] | None = None
    """Policy version that sampled each token, from engines whose adapter can change within a
    turn; None: every token is of the engine's version when the call returned."""


class Engine(Protocol):
    """What an actor needs from an inference engine.

    Usage::

        engine = make_engine("torch", model_path, lora, device="cpu")   # actors.engines
        outs = engine.generate(prompts, SamplingParams(8, stop_ids), sessions=ids, seeds=seeds)
        engine.load_adapter(version, tensors)   # between turns, when a new one arrives
    """

    version: int
    """Version of the adapter currently applied (0 = none yet)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: list[Hashable] | None = None,
                 seeds: list[int | None] | None = None,
                 images: list[list] | None = None,
                 greedy: list[bool] | None = None) -> list[Completion]:
        """Sample one completion per prompt. `sessions` names the episode of each prompt so
        an engine may reuse work across turns; prompts of a session only ever grow. `seeds`
        gives each prompt's request seed: its completion is then a function of (engine seed,
        request seed, prompt, weights) whatever else is in the batch; None (for all, or for
        one prompt) draws from the engine's generator, which the batch shares. `images`: each
        prompt's images (uint8 H×W×3), in the order of their expanded tokens in the prompt.
        `greedy` flags prompts to decode greedily inside a sampled batch: each token the most
        probable, its log-prob under the temperature's distribution (a greedy play GRPO can score
        beside the sampled ones)."""
        ...

    def load_adapter(self, version: int, tensors: dict) -> None:
        """Apply the LoRA adapter `tensors` (PEFT state-dict names) as policy version `version`."""
        ...

    def close(self) -> None:
        """Release the engine's memory."""
        ...


@runtime_checkable
class RequestEngine(Protocol):
    """An engine that takes one request per episode turn and answers each when it is done,
    so no turn waits for the rest of a batch.

    Usage::

        engine.submit(episode_id, prompt_ids, params, seed)  # the moment the observation is ready
        for episode_id, completion in engine.collect(timeout=0.01):
            ...                                            # step that episode's environment
        engine.load_adapter(version, tensors)              # requests started afterwards use it
    """

    version: int
    """Version of the newest adapter applied (0 = none yet)."""

    def submit(self, key: Hashable, prompt: list[int], params: SamplingParams,
               seed: int | None = None, images: list | None = None) -> None:
        """Start sampling one completion of `prompt`; `collect` returns it under `key`. With a
        `seed`, the completion depends on (engine seed, seed), not on the requests beside it.
        `images`: the prompt's images, in the order of their expanded tokens."""
        ...

    def collect(self, timeout: float = 0.0) -> list[tuple[Hashable, Completion]]:
        """The completions finished since the last call, waiting up to `timeout` for the first."""
        ...

    @property
    def pending(self) -> int:
        """Requests submitted and not yet collected."""
        ...

    def load_adapter(self, version: int, tensors: dict) -> None:
        """Apply adapter `version` to every request started from now on."""
        ...

    def abort(self) -> None:
        """Abort every request in flight; `collect` never returns them."""
        ...

    def close(self) -> None:
        """Abort what is running and release the engine's memory and processes."""
        ...


def engine_dtype(dtype: str, device: str) -> str:
    """The dtype an engine loads its weights in: "auto" is bfloat16 on CUDA, float32 elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"
