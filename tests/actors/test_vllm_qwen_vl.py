"""vLLM with Qwen2-VL, Qwen2.5-VL and Qwen3-VL pictures (GPU only: vLLM's CPU build here cannot import its
Qwen-VL modules without torchvision). The tiny random models of tests/policy/qwen_vl.py; one
engine a family."""

import pytest

from actors.engine import SamplingParams
from actors.engines import make_engine
from policy.load import LoraSpec
from tests.actors.test_vllm_images import check_image_parity
from tests.policy.test_qwen_vl import picture, pictured

pytestmark = [pytest.mark.slow, pytest.mark.gpu]  # skipped without CUDA (tests/conftest.py)

pytest.importorskip("vllm", reason="the vLLM engine tests need vLLM: pip install -e '.[test]'")

LORA = LoraSpec(rank=8)
TOLERANCE = (0.5, 1e-2)
"""(max |log μ − log π|, mismatch KL) of vLLM in bf16 against the learner's float32 scoring: the
text path's on a GPU (tests/actors/test_vllm_images.py)."""


@pytest.fixture(scope="module")
def engine(qwen_vl):
    engine = make_engine("vllm", qwen_vl, LORA, device="cuda", dtype="bfloat16", max_model_len=2048, max_images=16)
    yield engine
    engine.close()


def _prompts(chat):
    """Opening prompts with pictures of two sizes, and a second turn holding both."""
    a, b = picture(0), picture(1, 90, 140)
    first = chat.prompt_ids([pictured("start", a)])
    second = first + [chat.stop_ids[0]] + chat.observation_ids([pictured("moved", b)])
    return [first, chat.prompt_ids([pictured("start", b)]), second], [[a], [b], [a, b]]


def test_vllm_expands_a_collapsed_qwen_prompt_to_tandems_tokens(engine, qwen_vl_chat):
    """The prompt vLLM runs (its own expansion of each `<|image_pad|>` between vision_start and
    vision_end) is token for token the episode's expanded prompt."""
    from vllm import SamplingParams as VSamplingParams

    from actors.vllm_engine import _Turn

    for n, (prompt, pics) in enumerate(zip(*_prompts(qwen_vl_chat))):
        turn = _Turn("probe", prompt, SamplingParams(1, qwen_vl_chat.stop_ids), images=pics)

        async def run():
            async for out in engine.llm.generate(engine._prompt(turn), VSamplingParams(max_tokens=1), f"probe-{n}"):
                last = out
            return last

        assert engine._call(run()).prompt_token_ids == prompt


def test_qwen_image_logprobs_agree_with_the_learners_scoring(engine, qwen_vl, qwen_vl_chat):
    """μ recorded by vLLM against π scored as the learner scores (with the pictures and the
    rows' M-RoPE positions), the torch engine beside it; other pictures give other log-probs."""
    prompts, images = _prompts(qwen_vl_chat)
    check_image_parity(engine, qwen_vl, qwen_vl_chat, prompts, images, TOLERANCE, LORA)
