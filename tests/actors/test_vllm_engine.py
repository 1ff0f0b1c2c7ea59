"""The vLLM engine on a GPU: same token-in/token-out contract as the torch engine."""

import pytest

from actors.engine import SamplingParams, TorchEngine, make_engine
from policy.load import LoraSpec

pytestmark = pytest.mark.gpu


def test_vllm_logprobs_match_the_torch_engine(tiny_model, chat):
    pytest.importorskip("vllm")
    lora = LoraSpec(rank=8)
    engine = make_engine("vllm", tiny_model, lora, dtype="float32")
    ref = TorchEngine(tiny_model, lora, device="cuda")
    prompt = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    out = engine.generate([prompt], SamplingParams(4, chat.stop_ids, temperature=1.0))[0]
    assert 1 <= len(out.tokens) <= 4
    import torch

    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([prompt + out.tokens], device="cuda")).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    expected = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(out.tokens)]
    assert out.logprobs == pytest.approx(expected, abs=2e-2)
    engine.close()
