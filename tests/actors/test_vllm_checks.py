"""The vLLM engine's own checks, run without vLLM: what it refuses before vLLM would fail
obscurely, or not fail at all."""

import pytest
import torch

from actors.vllm_checks import adapter_shapes, check_adapter, check_vllm_version, lora_rank_slot
from policy.load import LoraSpec


def test_a_vllm_older_than_the_logprob_semantics_is_refused():
    check_vllm_version("0.10.2")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match="before temperature"):
        check_vllm_version("0.10.1.1")


def test_an_adapter_rank_gets_the_smallest_slot_vllm_accepts():
    assert [lora_rank_slot(r) for r in (1, 2, 8, 9, 32, 300, 512)] == [1, 8, 8, 16, 32, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        lora_rank_slot(513)


@pytest.mark.parametrize("model", ["tiny_model", "tiny_vlm"])
def test_an_adapter_that_does_not_fit_the_model_is_refused_with_its_reason(model, request):
    """Send the engine adapters as a faulty learner might: empty, of a higher rank than the
    engine holds, missing a tensor, with an extra one, or with a tensor of the wrong shape. Each
    is refused, naming what is wrong; the model's own adapter passes."""
    spec = LoraSpec(rank=4)
    shapes = adapter_shapes(request.getfixturevalue(model), spec)
    assert shapes and not any("vision_model" in name or "connector" in name for name in shapes)
    good = {name: torch.zeros(shape) for name, shape in shapes.items()}
    check_adapter(good, shapes, max_rank=8, version=1)
    a_name = next(n for n in good if ".lora_A." in n)
    cases = {
        "no tensors": {},
        "above the engine's --actor.max-lora-rank": {**good, a_name: torch.zeros(16, good[a_name].shape[1])},
        "missing": {n: t for n, t in good.items() if n != a_name},
        "tensors it lacks": {**good, "base_model.model.extra.lora_A.weight": torch.zeros(4, 4)},
        "has shape": {**good, a_name: torch.zeros(4, good[a_name].shape[1] + 1)},
    }
    for reason, tensors in cases.items():
        with pytest.raises(ValueError, match=reason):
            check_adapter(tensors, shapes, max_rank=8, version=3)
