"""`launch.merge`: a run's adapter folded into its base model and saved as a plain checkpoint.
Real PEFT and transformers on the tiny model; the adapter is saved as the learner saves it."""

import json

import pytest
import torch

from launch.merge import MergeArgs, main
from policy.adapter import write_adapter
from policy.load import LoraSpec
from tests.policy.test_adapter import _trained

SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture
def run(tiny_model, tmp_path):
    """A run directory holding an adapter that changes the model's outputs."""
    model, tensors = _trained(tiny_model, SPEC)
    write_adapter(tmp_path / "run" / "adapter", tensors, SPEC, tiny_model, 12)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    assert not torch.allclose(adapted, plain, atol=1e-3)  # the adapter does something
    return tmp_path / "run", ids, adapted


def test_the_merged_checkpoint_computes_what_base_plus_adapter_computes(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, ids, adapted = run
    out = main(MergeArgs(str(run_dir), out=str(tmp_path / "merged"), dtype="float32"))
    merged = AutoModelForCausalLM.from_pretrained(out)  # a plain checkpoint: no PEFT, no adapter
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template  # the chat template travels with it
    meta = json.loads((out / "tandem-merge.json").read_text())
    assert meta["version"] == 12 and meta["dtype"] == "float32"


def test_the_adapter_loads_with_peft_as_docs_say(run, tiny_model):
    """docs/serving.md: `PeftModel.from_pretrained(base, "runs/<run>/adapter")`, no merge."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, ids, adapted = run
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(run_dir / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)


def test_a_chosen_dtype_and_bad_input(run, tmp_path):
    from transformers import AutoConfig

    run_dir, _, _ = run
    out = main(MergeArgs(str(run_dir / "adapter"), out=str(tmp_path / "bf16"), dtype="bfloat16"))
    config = AutoConfig.from_pretrained(out)
    assert str(config.dtype).endswith("bfloat16")
    with pytest.raises(SystemExit, match="exists and is not an empty directory"):
        main(MergeArgs(str(run_dir), out=str(tmp_path / "bf16")))
    with pytest.raises(SystemExit, match="holds no adapter_model.safetensors"):
        main(MergeArgs(str(tmp_path), out=str(tmp_path / "x")))
