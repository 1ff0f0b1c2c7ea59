"""The vLLM engine (GPU only; `pip install -e '.[vllm]'`). Imported only when asked for.

Token in, token out: prompts go in as `TokensPrompt`s and the sampled token ids
come back with their log-probs (`logprobs=0` returns the sampled token's).
The engine is built with `logprobs_mode="processed_logprobs"`, so a log-prob is
taken after temperature, like the torch engine's and the learner's.

Adapters: vLLM loads LoRA adapters from a directory, so each published adapter
is written in PEFT format to a private temporary directory and used through a
new `LoRARequest` id (vLLM caches adapters by id; a new version needs a new
id). vLLM's prefix cache reuses the KV of earlier turns, so `sessions` needs no
bookkeeping here.

Colocated mode: `sleep()` frees the GPU memory of the weights and KV cache while
the learner trains; `wake_up()` restores it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Hashable
from pathlib import Path

from actors.engine import Completion, SamplingParams


class VLLMEngine:
    def __init__(self, model_path: str, lora, seed: int = 0, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, max_model_len: int = 4096) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError("the vLLM engine needs vLLM on a GPU machine: pip install -e '.[vllm]'") from exc
        self.model_path, self.lora, self.seed = model_path, lora, seed
        self.llm = LLM(model=model_path, enable_lora=True, max_lora_rank=max(lora.rank, 8), max_loras=2,
                       dtype="float32" if dtype == "float32" else dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enable_prefix_caching=True, enable_sleep_mode=True,
                       logprobs_mode="processed_logprobs")
        self._dir = Path(tempfile.mkdtemp(prefix="tandem-lora-"))
        self._request = None
        self.version = 0

    def load_adapter(self, version: int, tensors: dict) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        path = self._dir / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
        config = self.lora.peft_config().to_dict()
        config["base_model_name_or_path"] = self.model_path
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        (path / "adapter_config.json").write_text(json.dumps(config, default=str))
        old = self._request
        self._request = LoRARequest(f"tandem-v{version}", version + 1, str(path))
        self.version = version
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: list[Hashable] | None = None) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sp = VSamplingParams(temperature=params.temperature, max_tokens=params.max_new_tokens,
                             stop_token_ids=list(params.stop_ids), logprobs=0, detokenize=False,
                             skip_special_tokens=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                                 lora_request=self._request, use_tqdm=False)
        result = []
        for out in outs:
            c = out.outputs[0]
            tokens = list(c.token_ids)
            logprobs = [float(step[t].logprob) for t, step in zip(tokens, c.logprobs)]
            result.append(Completion(tokens, logprobs, stopped=bool(tokens) and tokens[-1] in params.stop_ids))
        return result

    def sleep(self) -> None:
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
        del self.llm
