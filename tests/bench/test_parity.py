"""bench/parity.py's scoring on the CPU: the torch engine's log-probs against the learner's, on
Qwen-VL prompts with pictures of two sizes (its M-RoPE positions included), with a random adapter."""

from actors.engine import SamplingParams
from actors.torch_engine import TorchEngine
from bench.parity import compare, random_adapter
from policy.load import LoraSpec
from tests.policy.test_qwen_vl import picture, pictured


def test_the_torch_engine_agrees_with_the_learner_on_qwen_pictures(qwen_vl, qwen_vl_chat):
    chat, lora = qwen_vl_chat, LoraSpec(rank=4)
    a, b = picture(0), picture(1, 90, 140)
    first = chat.prompt_ids([pictured("start", a)])
    prompts = [first, first + [chat.stop_ids[0]] + chat.observation_ids([pictured("moved", b)])]
    ref = compare(TorchEngine(qwen_vl, lora, seed=0), qwen_vl, lora, random_adapter(qwen_vl, lora), prompts,
                  SamplingParams(6, chat.stop_ids, temperature=1.0), images=[[a], [a, b]])
    assert ref["max_abs"] < 5e-4 and ref["kl"] < 1e-8, ref
