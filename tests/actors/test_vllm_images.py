"""vLLM with pictures, run as a user would run it: vLLM's CPU build here serving the built-in
tiny vision-language model (Idefics3). One engine serves the whole module."""

import numpy as np
import pytest
import torch

from actors.engine import SamplingParams
from actors.engines import make_engine
from actors.torch_engine import TorchEngine
from bench.parity import compare, image_prompts_for, random_adapter
from policy.load import LoraSpec

pytestmark = pytest.mark.slow  # a vLLM engine (its CPU build) starts for this module: `pytest -m slow`

pytest.importorskip("vllm", reason="the vLLM engine tests need vLLM: pip install -e '.[test]'")

LORA = LoraSpec(rank=8)
CUDA = torch.cuda.is_available()
DTYPE = "bfloat16" if CUDA else "float32"
TOLERANCE = {"float32": (5e-4, 1e-8), "bfloat16": (0.5, 1e-2)}[DTYPE]
"""(max |log μ − log π|, mismatch KL) against the learner's float32 scoring: the text path's."""


@pytest.fixture(scope="module")
def engine(tiny_vlm):
    engine = make_engine("vllm", tiny_vlm, LORA, device="auto", dtype=DTYPE, max_model_len=2048, max_images=16)
    yield engine
    engine.close()


def test_vllm_expands_a_collapsed_prompt_to_tandems_tokens(engine, vlm_chat):
    """The prompt vLLM runs (its own expansion of one placeholder per picture) is token for
    token the episode's expanded prompt that the learner trains on."""
    from vllm import SamplingParams as VSamplingParams

    from actors.vllm_engine import _Turn

    prompts, images = image_prompts_for(vlm_chat, 2)
    second = prompts[0] + [vlm_chat.stop_ids[0]] + vlm_chat.observation_ids(
        [{"role": "user", "content": [{"type": "text", "text": "moved"}, {"type": "image", "image": images[1][0]}]}])
    for prompt, pics in [(prompts[0], images[0]), (second, images[0] + images[1])]:
        turn = _Turn("probe", prompt, SamplingParams(1, vlm_chat.stop_ids), images=pics)

        async def run():
            async for out in engine.llm.generate(engine._prompt(turn), VSamplingParams(max_tokens=1),
                                                 f"probe-{len(pics)}"):
                last = out
            return last

        assert engine._call(run()).prompt_token_ids == prompt


def check_image_parity(engine, model, chat, prompts, images, tolerance, lora=LORA) -> None:
    """μ recorded by vLLM on image `prompts` against π scored as the learner scores (the same
    pictures, adapter on the language model, temperature), the torch engine beside it within the
    text path's CPU tolerance; no image placeholder sampled; grey pictures change vLLM's log-probs
    by more than 1e-3, so the pictures reach it. Shared by every family's vLLM image test."""
    from bench.parity import learner_logprobs

    tensors = random_adapter(model, lora)
    params = SamplingParams(10, chat.stop_ids, temperature=1.0)
    vllm = compare(engine, model, lora, tensors, prompts, params, images=images)
    ref = compare(TorchEngine(model, lora, seed=0), model, lora, tensors, prompts, params, images=images)
    assert vllm["max_abs"] < tolerance[0] and vllm["kl"] < tolerance[1], vllm
    assert ref["max_abs"] < 5e-4 and ref["kl"] < 1e-8, ref
    for _, tokens, _ in vllm["sequences"] + ref["sequences"]:
        assert not set(tokens) & set(chat.scheme.special_ids), "an image placeholder was sampled"
    grey = [[np.full_like(i, 128) for i in pics] for pics in images]
    blind = compare(engine, model, lora, tensors, prompts, params, images=grey)
    seen = learner_logprobs(model, lora, tensors, [p + t for p, t, _ in blind["sequences"]], 1.0, images=images)
    gap = max(abs(mu - s[len(p) + j]) for (p, _, lps), s in zip(blind["sequences"], seen) for j, mu in enumerate(lps))
    assert gap > 1e-3, "vLLM's log-probs did not depend on the pictures"


def test_image_logprobs_agree_with_the_learners_scoring_with_the_pictures(engine, tiny_vlm, vlm_chat):
    """Parity on image-maze opening prompts with the built-in tiny VLM."""
    prompts, images = image_prompts_for(vlm_chat, 6)
    check_image_parity(engine, tiny_vlm, vlm_chat, prompts, images, TOLERANCE)


def test_an_actor_plays_the_image_maze_with_vllm(engine, tiny_vlm, vlm_chat):
    """Episodes of several turns: every observation's picture goes into the next request, the
    trajectory keeps them in order, and the tokens vLLM sampled are those recorded."""
    from actors.envrunner import EnvRunner
    from actors.rollout import close, play, start
    from envs import make_env

    runner = EnvRunner(threads=2)
    try:
        episodes = [start(make_env("image-maze", max_steps=3), vlm_chat, runner, seed=s, sampling_seed=s)
                    for s in range(4)]
        play(engine, vlm_chat, episodes, SamplingParams(4, vlm_chat.stop_ids, temperature=1.0), 2048, runner)
        for e in episodes:
            close(e)
    finally:
        runner.close()
    for e in episodes:
        t = e.trajectory()
        assert e.finish_reason in ("terminated", "truncated"), e.error
        image_id = vlm_chat.scheme.image_token_id
        assert int((t.tokens == image_id).sum()) == 16 * len(t.images) and len(t.images) >= 1
        assert not (t.mask.astype(bool) & np.isin(t.tokens, vlm_chat.scheme.special_ids)).any()

