"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL images in the token stream: Tandem's expansion, pixels and M-RoPE
positions against the family's Hugging Face processor and model (tiny random models built in
tests/policy/qwen_vl.py, the published Qwen2.5-VL chat template)."""

import numpy as np
import pytest
import torch

from policy.load import LoraSpec, load_model, with_lora
from policy.vision import VisionError, collapse, expand


def picture(seed: int, h: int = 64, w: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def pictured(text: str, image: np.ndarray, first: bool = True) -> dict:
    parts = [{"type": "text", "text": text}, {"type": "image", "image": image}]
    return {"role": "user", "content": parts if first else parts[::-1]}


def processor(path: str, monkeypatch):
    """The family's own processor around its PIL image processor. Its constructor checks the
    video processor's class, which needs torchvision (absent here); no video is processed, so
    that check is skipped."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    family = AutoConfig.from_pretrained(path).model_type
    cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[family]
    tok = AutoTokenizer.from_pretrained(path)
    return cls(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer=tok, video_processor=None,
               chat_template=tok.chat_template)


def episode(chat, images):
    """An episode as the actors build it (prompt, model turn, observation, ...), one picture a
    user message, and the same conversation as messages."""
    opening = [pictured("start", images[0])]
    ids, messages = chat.prompt_ids(opening), list(opening)
    for k, image in enumerate(images[1:]):
        answer = f"move {k}"
        obs = [pictured("moved", image, first=k % 2 == 0)]
        ids += chat.tokenizer.encode(answer, add_special_tokens=False) + [chat.stop_ids[0]] + chat.observation_ids(obs)
        messages += [{"role": "assistant", "content": answer}, *obs]
    return ids, messages


def test_an_episode_expands_to_the_processors_tokens_and_pixels(qwen_vl, qwen_vl_chat, monkeypatch):
    """Pictures of two sizes in a multi-turn episode: the token ids equal the processor's on the
    template's rendering of the whole conversation, and so do the pixels and grids; collapsing
    gives back the template's one placeholder a picture (what vLLM expands itself)."""
    images = [picture(0), picture(1, 90, 140)]
    ours, messages = episode(qwen_vl_chat, images)
    proc = processor(qwen_vl, monkeypatch)
    text = proc.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    theirs = proc(text=[text], images=images, return_tensors="pt")
    assert ours == theirs["input_ids"][0].tolist()
    scheme = qwen_vl_chat.scheme
    counts = [len(scheme.expansion(i)) - 2 for i in images]
    assert counts[0] != counts[1] and ours.count(scheme.image_token_id) == sum(counts)
    pixels = scheme.pixels([images[:1], images[1:]])  # two rows: concatenated in order
    torch.testing.assert_close(pixels["pixel_values"], theirs["pixel_values"], rtol=0, atol=0)
    assert pixels["image_grid_thw"].tolist() == theirs["image_grid_thw"].tolist()
    assert collapse(scheme, ours, images) == proc.tokenizer(text, add_special_tokens=False)["input_ids"]


def _rope_index(model, ids, grids, image_token_id):
    """The model's own get_rope_index on one sequence (token types from the ids, as the
    processor's mm_token_type_ids)."""
    ids = torch.tensor([ids])
    with torch.no_grad():
        positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == image_token_id).int(),
                                                  image_grid_thw=grids)
    return positions[:, 0]


def test_positions_are_the_models_rope_index_whole_or_turn_by_turn(qwen_vl, qwen_vl_chat):
    """M-RoPE positions of a four-turn episode with pictures of three sizes equal the model's
    get_rope_index on the whole sequence; and computed turn by turn, each turn offset by the
    row's next position (as the torch engine feeds a kept cache), they are the same."""
    from policy.mrope import next_position

    scheme = qwen_vl_chat.scheme
    images = [picture(0), picture(1, 90, 140), picture(2, 140, 60), picture(3)]
    ids, _ = episode(qwen_vl_chat, images)
    model = load_model(qwen_vl)
    grids = scheme.pixels([images])["image_grid_thw"]
    ours = scheme.positions(ids, images)
    assert torch.equal(ours, _rope_index(model, ids, grids, scheme.image_token_id))
    assert ours.max() < len(ids) - 10  # images advance the positions by less than their tokens
    prefix, _ = episode(qwen_vl_chat, images[:2])
    head = scheme.positions(prefix, images[:2])
    tail = scheme.positions(ids[len(prefix):], images[2:]) + next_position(head)
    assert torch.equal(torch.cat([head, tail], dim=1), ours)


def test_text_cannot_open_a_qwen_image_slot(qwen_vl_chat):
    with pytest.raises(VisionError, match="text must not contain"):
        qwen_vl_chat.prompt_ids([{"role": "user", "content": "look: <|image_pad|>"}])
    with pytest.raises(VisionError, match="more image placeholders"):
        qwen_vl_chat.observation_ids([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"}])
    scheme = qwen_vl_chat.scheme
    with pytest.raises(VisionError, match="2 image"):
        expand(scheme, [100, *scheme.placeholder, 101], [picture(0), picture(1)])


def test_the_adapter_leaves_the_qwen_vision_tower_alone(qwen_vl):
    """LoRA adapts the language model only (Qwen's vision tower, `visual`, has q/k/v-like
    linears of its own); `vision_tower` adapts the vision side too."""
    from peft import get_peft_model_state_dict

    text_only = get_peft_model_state_dict(with_lora(load_model(qwen_vl), LoraSpec(rank=2)))
    assert text_only and all(".language_model." in name for name in text_only)
    assert not any(".visual." in name for name in text_only)
    everything = get_peft_model_state_dict(with_lora(load_model(qwen_vl), LoraSpec(rank=2, vision_tower=True)))
    assert any(".visual." in name for name in everything) and set(text_only) < set(everything)


def test_cached_patches_equal_the_processors_and_the_cache_stays_bounded(qwen_vl_chat, monkeypatch):
    """The same pictures scored twice (as the learner does in a step) give the same pixels, the
    second time from the cache, which never holds more than its byte budget."""
    import policy.vision as vision

    scheme = qwen_vl_chat.scheme
    rows = [[picture(10), picture(11, 90, 140)], [picture(11, 90, 140)]]
    first, again = scheme.pixels(rows), scheme.pixels(rows)
    for name in first:
        torch.testing.assert_close(first[name], again[name], rtol=0, atol=0)
    one = scheme._processed(picture(12))[0]
    monkeypatch.setattr(vision, "PIXEL_CACHE_BYTES", 3 * one.numel() * one.element_size())
    for seed in range(20, 30):
        scheme.pixels([[picture(seed)]])
        assert scheme._processed.bytes <= vision.PIXEL_CACHE_BYTES
    fresh = scheme.image_processor([picture(29)], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(scheme.pixels([[picture(29)]])["pixel_values"], fresh, rtol=0, atol=0)
