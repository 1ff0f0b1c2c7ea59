"""Sampling for the Tinker API on Tandem's engines: the torch engine (actors/torch_engine.py) or
vLLM (actors/vllm_engine.py), as `--actor.engine` says.

One engine per LoRA shape (rank and adapted modules), started when first needed (the base model
runs on any engine already started, with an all-zero adapter of its shape); a sampling
session names an adapter (its tensors: a snapshot of a training client, a saved checkpoint, or
none for the base model) and the engine loads it, as the weight channel's adapters are loaded
into actors (`load_adapter`: vLLM gets it in PEFT format from tmpfs under a new LoRA id),
before the session's request when another is applied. The torch engine runs the LoRA branch
unmerged (`merge_lora=False`): folding an adapter on a tied output head into its weight would
change the input embeddings too.

A request's `num_samples` completions are one batch of the engine, each seeded from the
request's seed and its index when a seed is given (the engine's reproducible per-request
streams), from the engine's generator otherwise. Stop tokens are the engine's; stop strings are
applied to the decoded text after each token, a sequence ending with the token that completed
the string. The sampled log-probs are those of the distribution sampled (after temperature,
top-k and top-p). Prompt log-probs (`compute_logprobs`) are the learner's log-probs
(learner/logprobs.py) under the same weights: with vLLM sampling, a torch engine of the same
shape is started for them when first asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine import SamplingParams, stream_seed
from actors.engines import make_engine
from actors.torch_engine import TorchEngine
from learner.logprobs import target_logprobs
from policy.load import LoraSpec, load_tokenizer
from serve.wire import Sequence

MAX_STOP_STRINGS = 32


@dataclass
class Weights:
    """What a sampling session samples with."""

    key: str
    """Names these weights (a path or a snapshot id): the engine reloads when it changes."""
    spec: LoraSpec | None
    """The adapter's shape; None for the base model."""
    tensors: dict | None


class Sampler:
    """Sampling and prompt log-probs under given weights.

    Usage::

        sampler = Sampler(model_dir)                  # or Sampler(model_dir, "vllm", options, "cpu")
        seqs, prompt_lp = sampler.sample(weights, prompt, n=4, max_tokens=16, temperature=1.0,
                                         top_k=-1, top_p=1.0, stop=None, seed=7, prompt_logprobs=False)
    """

    def __init__(self, model_path: str, engine: str = "torch", options: dict | None = None,
                 device: str = "cpu") -> None:
        """`engine`, `options`, `device`: `make_engine`'s (actors/engines.py), from the --actor section."""
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.kind, self.device = engine, device
        self.options = dict(options or {})
        if engine == "torch":
            self.options["merge_lora"] = False
        self.engines: dict[tuple, object] = {}  # (kind, shape) -> engine
        self.applied: dict[tuple, str] = {}  # shape -> the key of the weights applied
        self.specs: dict[tuple, LoraSpec] = {}  # shape -> its LoraSpec
        self.zeros: dict[tuple, dict] = {}  # shape -> its all-zero adapter (the base model), made once

    def _engine(self, weights: Weights, kind: str | None = None):
        """The engine of `kind` (default: the sampler's) for `weights`' LoRA shape, with them applied."""
        kind = kind or self.kind
        spec = weights.spec
        if spec is None:  # the base model: any engine of this kind, with an adapter that adds nothing
            spec = next((s for k, s in self.specs.items() if k[0] == kind), LoraSpec(rank=1, target_modules=["q_proj"]))
        shape = (kind, spec.rank, spec.alpha, tuple(spec.target_modules))
        engine = self.engines.get(shape)
        if engine is None:
            options = self.options if kind == self.kind else {"merge_lora": False}
            if kind == "vllm" and self.device == "cuda":  # beside learner rank 0 on GPU 0
                from actors.gpu_memory import check_room_beside

                check_room_beside(options["memory_fraction"], torch.device("cuda", 0))
            engine = self.engines[shape] = make_engine(kind, self.model_path, spec, device=self.device, **options)
            self.specs[shape] = spec
            self.applied[shape] = "base"  # version 0: no adapter (vLLM), or one whose B is zero (torch)
        if self.applied[shape] != weights.key:
            tensors = weights.tensors
            if tensors is None:  # the base model: the adapter's B is zero, its update nothing
                if shape not in self.zeros:
                    self.zeros[shape] = zero_adapter(self.model_path, spec)
                tensors = self.zeros[shape]
            engine.load_adapter(engine.version + 1, tensors)
            self.applied[shape] = weights.key
        return engine

    def check_length(self, prompt: int, max_tokens: int) -> None:
        """Refuse a request longer than a vLLM engine's context (--actor.max-tokens)."""
        limit = self.options.get("max_model_len") if self.kind == "vllm" else None
        if limit is not None and prompt + max_tokens > limit:
            raise ValueError(f"a prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the sampling "
                             f"engine's context of {limit} tokens (--actor.max-tokens)")

    def stop_ids(self, stop) -> tuple[tuple[int, ...], list[str]]:
        """(stop tokens, stop strings) of the API's `stop`: None stops on eos; [] on nothing."""
        if stop is None:
            eos = self.tokenizer.eos_token_id
            return ((eos,) if eos is not None else ()), []
        if isinstance(stop, str):
            stop = [stop]
        stop = list(stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stop)}")
        if all(isinstance(s, int) for s in stop):
            vocab = len(self.tokenizer)
            bad = [s for s in stop if not 0 <= s < vocab]
            if bad:
                raise ValueError(f"stop token {bad[0]} is outside the vocabulary [0, {vocab})")
            return tuple(stop), []
        if all(isinstance(s, str) and s for s in stop):
            return (), stop
        raise ValueError("stop must be a string, a list of non-empty strings or a list of token ids")

    def sample(self, weights: Weights, prompt: list[int], n: int, max_tokens: int, temperature: float,
               top_k: int, top_p: float, stop, seed: int | None,
               prompt_logprobs: bool) -> tuple[list[Sequence], list[float | None] | None]:
        engine = self._engine(weights)
        stop_ids, stop_strings = self.stop_ids(stop)
        params = SamplingParams(max_tokens, stop_ids, temperature=temperature, top_k=top_k, top_p=top_p)
        seeds = None if seed is None else [stream_seed(seed, i) for i in range(n)]
        outs = engine.generate([list(prompt)] * n, params, seeds=seeds)
        seqs = [self._cut(Sequence(list(o.tokens), list(o.logprobs), o.stopped), stop_strings) for o in outs]
        return seqs, (self.prompt_logprobs(self._engine(weights, "torch"), prompt) if prompt_logprobs else None)

    def _cut(self, seq: Sequence, stop_strings: list[str]) -> Sequence:
        """`seq` up to and including the token whose text completes the first stop string."""
        if not stop_strings:
            return seq
        for t in range(1, len(seq.tokens) + 1):
            text = self.tokenizer.decode(seq.tokens[:t])
            if any(s in text for s in stop_strings):
                return Sequence(seq.tokens[:t], seq.logprobs[:t], True)
        return seq

    @torch.inference_mode()
    def prompt_logprobs(self, engine: TorchEngine, prompt: list[int]) -> list[float | None]:
        """log π(prompt[t] | prompt[:t]) for t ≥ 1, None at position 0."""
        if len(prompt) < 2:
            return [None] * len(prompt)
        ids = torch.tensor([prompt[:-1]], dtype=torch.long, device=engine.device)
        targets = torch.tensor([prompt[1:]], dtype=torch.long, device=engine.device)
        logp = target_logprobs(engine.model, ids, targets, torch.ones_like(ids))[0]
        return [None] + logp.float().cpu().tolist()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


def zero_adapter(model_path: str, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """An adapter of shape `spec` that changes nothing (all zeros): the base model, for an engine
    that always applies one. Shapes from a model on the meta device: no weights read."""
    from actors.vllm_checks import adapter_shapes

    return {k: torch.zeros(shape) for k, shape in adapter_shapes(model_path, spec).items()}
