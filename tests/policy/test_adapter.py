"""The adapter directory: the bytes Tandem has always saved, read back whole, loadable by PEFT."""

import json

import pytest
import torch

from policy.adapter import Adapter, adapter_config, read_adapter, write_adapter
from policy.load import LoraSpec, load_model, with_lora

SPECS = [LoraSpec(), LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])]


def _trained(tiny_model, spec):
    """The tiny model with `spec`'s adapter, its B matrices moved off zero (an adapter that does something)."""
    from peft import get_peft_model_state_dict

    torch.manual_seed(0)
    model = with_lora(load_model(tiny_model), spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model, {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize("spec", SPECS, ids=["all-linear", "q_v"])
def test_the_files_are_the_bytes_the_learner_has_always_written(tiny_model, spec, tmp_path):
    from safetensors.torch import save_file

    model, tensors = _trained(tiny_model, spec)
    write_adapter(tmp_path / "new", tensors, spec, tiny_model, 7)
    # The layout as the learner wrote it before this module owned it: the live PEFT model's config.
    old = tmp_path / "old"
    old.mkdir()
    save_file(tensors, str(old / "adapter_model.safetensors"))
    config = model.peft_config["default"].to_dict()
    config["base_model_name_or_path"] = tiny_model
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    (old / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    (old / "tandem.json").write_text(json.dumps({"version": 7}))
    for name in ("adapter_model.safetensors", "adapter_config.json", "tandem.json"):
        assert (tmp_path / "new" / name).read_bytes() == (old / name).read_bytes(), name


@pytest.mark.parametrize("spec", SPECS, ids=["all-linear", "q_v"])
def test_an_adapter_reads_back_whole_and_peft_loads_it(tiny_model, spec, tmp_path):
    from peft import PeftModel

    model, tensors = _trained(tiny_model, spec)
    write_adapter(tmp_path, tensors, spec, tiny_model, 3)
    saved = read_adapter(tmp_path)
    assert isinstance(saved, Adapter) and saved.version == 3 and saved.base_model == tiny_model
    assert saved.config["r"] == spec.rank and saved.config["lora_alpha"] == spec.alpha
    assert "all-linear" not in saved.config["target_modules"]  # named explicitly, as vLLM needs
    assert saved.tensors.keys() == tensors.keys()
    for k in tensors:
        torch.testing.assert_close(saved.tensors[k], tensors[k], rtol=0, atol=0)
    loaded = PeftModel.from_pretrained(load_model(tiny_model), str(tmp_path))
    ids = torch.tensor([[5, 9, 17, 3, 40]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("spec", SPECS, ids=["all-linear", "q_v"])
def test_an_adapter_reads_back_with_the_lora_spec_it_was_saved_with(tiny_model, spec, tmp_path):
    """Rank, alpha and target modules; "all-linear" comes back as the modules it named, which
    builds the same layers."""
    _, tensors = _trained(tiny_model, spec)
    write_adapter(tmp_path, tensors, spec, tiny_model, 3)
    back = read_adapter(tmp_path).lora_spec()
    assert (back.rank, back.alpha) == (spec.rank, spec.alpha)
    assert back.target_modules == sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    _, rebuilt = _trained(tiny_model, back)
    assert rebuilt.keys() == tensors.keys()


def test_the_config_names_the_adapted_modules_from_the_tensors():
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 4),
               "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": torch.zeros(4, 2)}
    config = adapter_config(LoraSpec(rank=2), tensors, "base")
    assert config["target_modules"] == ["q_proj", "up_proj"] and config["base_model_name_or_path"] == "base"


def test_a_directory_that_is_not_an_adapter_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        read_adapter(tmp_path)
    write_adapter(tmp_path, {"x.q_proj.lora_A.weight": torch.zeros(1, 2)}, LoraSpec(rank=1), "base", 1)
    (tmp_path / "tandem.json").unlink()
    with pytest.raises(FileNotFoundError, match="tandem.json"):
        read_adapter(tmp_path)
    (tmp_path / "tandem.json").write_text("{}")
    with pytest.raises(ValueError, match="tandem.json"):
        read_adapter(tmp_path)
    with pytest.raises(ValueError, match="no tensors"):
        write_adapter(tmp_path / "empty", {}, LoraSpec(rank=1), "base", 1)


@pytest.mark.parametrize("vision_tower", [False, True])
def test_a_vision_language_adapter_reads_back_with_the_modules_it_adapts(tiny_vlm, vision_tower, tmp_path):
    """On a vision-language model the saved config excludes the vision side (unless it was
    trained too), so PEFT loads adapters on exactly the modules that were trained, and reading
    the adapter back gives the spec it was trained with."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    spec = LoraSpec(rank=4, vision_tower=vision_tower)
    model, tensors = _trained(tiny_vlm, spec)
    write_adapter(tmp_path, tensors, spec, tiny_vlm, 2)
    got = read_adapter(tmp_path).lora_spec()
    assert (got.rank, got.alpha, got.vision_tower) == (spec.rank, spec.alpha, vision_tower)
    loaded = PeftModel.from_pretrained(load_model(tiny_vlm), str(tmp_path))
    adapted = {n for n, m in loaded.named_modules() if isinstance(m, LoraLayer)}
    assert adapted == {n for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert any(".vision_model." in n for n in adapted) == vision_tower


def test_an_adapter_excluding_other_modules_is_refused(tiny_vlm, tmp_path):
    spec = LoraSpec(rank=4)
    _, tensors = _trained(tiny_vlm, spec)
    write_adapter(tmp_path, tensors, spec, tiny_vlm, 1)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config["exclude_modules"] = ".*mlp.*"
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="exclude_modules"):
        read_adapter(tmp_path).lora_spec()
