"""Images in the token stream: Tandem's expansion against the family's Hugging Face processor."""

import numpy as np
import pytest
import torch

from policy.load import LoraSpec, load_model, with_lora
from policy.vision import VisionError, collapse, expand, scheme_for


def picture(seed: int, size: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def pictured(text: str, image: np.ndarray, role: str = "user") -> dict:
    return {"role": role, "content": [{"type": "text", "text": text}, {"type": "image", "image": image}]}


def test_an_episode_expands_to_the_processors_tokens_and_pixels(tiny_vlm, vlm_chat):
    """Render a two-image episode as the actors do (prompt, model turn, observation) and as
    the Hugging Face processor does on the whole conversation: same ids, same pixels."""
    from transformers import AutoProcessor

    a, b = picture(0), picture(1)
    opening, answer, obs = [pictured("start", a)], {"role": "assistant", "content": "up"}, [pictured("moved", b)]
    ours = vlm_chat.prompt_ids(opening) + vlm_chat.tokenizer.encode("up", add_special_tokens=False)
    ours += list(vlm_chat.stop_ids[:1]) + vlm_chat.observation_ids(obs)
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    text = processor.tokenizer.apply_chat_template(opening + [answer] + obs, tokenize=False, add_generation_prompt=True)
    theirs = processor(text=[text], images=[[a, b]], add_special_tokens=False, return_tensors="pt")
    assert ours == theirs["input_ids"][0].tolist()
    image_id = vlm_chat.scheme.image_token_id
    assert ours.count(image_id) == 2 * 16  # one image token a maze cell, per picture
    pixels = vlm_chat.scheme.pixels([[a, b]])
    torch.testing.assert_close(pixels["pixel_values"], theirs["pixel_values"], rtol=0, atol=0)
    # and back to one placeholder per image, the form vLLM expands itself
    rendered = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert collapse(vlm_chat.scheme, ours, [a, b]) == rendered


def test_text_cannot_open_an_image_slot(vlm_chat):
    """An environment (or a user) writing the image token in text gets a clear error: the
    model would otherwise be fed an image slot with no picture."""
    with pytest.raises(VisionError, match="text must not contain"):
        vlm_chat.prompt_ids([{"role": "user", "content": "look: <image>"}])
    with pytest.raises(VisionError, match="text must not contain"):
        vlm_chat.observation_ids([{"role": "user", "content": "<fake_token_around_image>"}])


def test_a_text_model_refuses_images(chat):
    with pytest.raises(VisionError, match="text model"):
        chat.prompt_ids([pictured("start", picture(0))])


def test_expand_needs_one_image_per_placeholder(vlm_chat):
    scheme = vlm_chat.scheme
    ids = [5, scheme.image_token_id, 6]
    with pytest.raises(VisionError, match="1 image"):
        expand(scheme, ids + [scheme.image_token_id], [picture(0)])
    with pytest.raises(VisionError, match="2 image"):
        expand(scheme, ids, [picture(0), picture(1)])


def test_a_vision_language_adapter_leaves_the_vision_tower_alone(tiny_vlm):
    """By default LoRA adapts the language model only (the vision side is frozen, as in the
    published run); `vision_tower` adapts the vision tower and connector too."""
    from peft import get_peft_model_state_dict

    text_only = get_peft_model_state_dict(with_lora(load_model(tiny_vlm), LoraSpec(rank=2)))
    assert text_only and all(".text_model." in name for name in text_only)
    everything = get_peft_model_state_dict(with_lora(load_model(tiny_vlm), LoraSpec(rank=2, vision_tower=True)))
    assert any(".vision_model." in name for name in everything) and set(text_only) < set(everything)


def test_a_text_model_has_no_scheme(tiny_model):
    assert scheme_for(tiny_model) is None


def test_cached_pixels_equal_the_processors_and_the_cache_stays_bounded(vlm_chat, monkeypatch):
    """Score the same pictures twice, as the learner does in one step: the second call's pixels
    (from the cache) equal the first's, and the cache never holds more than its byte budget.
    Pictures of 48 px, which the processor resizes, take the cached path."""
    import policy.vision as vision

    def picture(seed):
        return np.random.default_rng(seed).integers(0, 256, (48, 48, 3), dtype=np.uint8)

    scheme = vlm_chat.scheme
    rows = [[picture(10), picture(11)], [picture(11)]]
    assert scheme._direct(picture(10)) is None
    first = scheme.pixels(rows)
    again = scheme.pixels(rows)
    for name in first:
        torch.testing.assert_close(first[name], again[name], rtol=0, atol=0)
    one = sum(t.numel() * t.element_size() for t in scheme._tiles(picture(12)))
    monkeypatch.setattr(vision, "PIXEL_CACHE_BYTES", 3 * one)
    for seed in range(20, 30):
        scheme.pixels([[picture(seed)]])
        assert scheme._tiles.bytes <= 3 * one
    fresh = scheme.image_processor([[picture(29)]], return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(scheme.pixels([[picture(29)]])["pixel_values"][0], fresh, rtol=0, atol=0)


def test_pictures_of_the_encoders_size_skip_the_processor_with_the_same_pixels(vlm_chat):
    """The image maze's pictures (and any 64×64 picture) are rescaled and normalised without the
    processor's resizes: bit for bit the processor's pixels; other sizes go through it."""
    from envs.image_maze import ImageMazeEnv

    scheme = vlm_chat.scheme
    env = ImageMazeEnv()
    pictures = [picture(seed) for seed in range(5)]
    pictures += [env.reset(seed=seed)[0][0]["content"][1]["image"] for seed in range(5)]
    pictures += [np.zeros((64, 64, 3), np.uint8), np.full((64, 64, 3), 255, np.uint8)]
    for image in pictures:
        theirs = scheme.image_processor([[image]], return_tensors="pt")
        values, mask = scheme._direct(image)
        torch.testing.assert_close(values, theirs["pixel_values"][0], rtol=0, atol=0)
        torch.testing.assert_close(mask, theirs["pixel_attention_mask"][0], rtol=0, atol=0)
    ours = scheme.pixels([pictures[:3], pictures[3:4]])
    theirs = scheme.image_processor([pictures[:3], pictures[3:4]], return_tensors="pt")
    for name in ("pixel_values", "pixel_attention_mask"):
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)
    for other in (picture(0, 32), picture(0, 128), picture(0, 64)[:, :48], picture(0, 64).astype(np.float32)):
        assert scheme._direct(other) is None


def test_the_tiny_vlms_vision_tower_starts_knowing_where_each_patch_is(tiny_vlm):
    """Its position embeddings are the 2-D grid's sines and cosines at the patch embedding's scale,
    so each patch's row and column are there before any training."""
    from policy.tiny import IMAGE_SIZE, POSITION_SCALE, VISION, grid_positions

    side = IMAGE_SIZE // VISION["patch"]
    table = grid_positions(side, VISION["hidden"], POSITION_SCALE)
    assert table.shape == (side * side, VISION["hidden"])
    assert abs(table.std().item() - POSITION_SCALE) < 1e-4
    assert len({tuple(row) for row in table.tolist()}) == side * side  # every patch its own
    model = load_model(tiny_vlm)
    torch.testing.assert_close(model.model.vision_model.embeddings.position_embedding.weight, table)
