"""Tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models with random weights, saved in Hugging Face format.

Each is the family's own transformers architecture at toy size (vision depth 2 of width 64, a
2-layer text model of width 64; heads of 32, a size every vLLM attention backend takes), with the
local tokenizer of tests/policy/templates.py (the Qwen2.5-VL chat template and the Qwen-VL special
tokens) and the family's PIL image processor, so `scheme_for` and `load_model` load them as they
load real checkpoints. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Config `model_type`s of the families built here."""

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=4096)
MROPE = [4, 6, 6]
"""Rotary pairs for time, height and width: head_dim 32 has 16."""

IMAGE_PROCESSOR = {
    "qwen2_vl": dict(patch_size=14, merge_size=2, temporal_patch_size=2,
                     size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}),
    # Qwen2-VL and Qwen2.5-VL: 14-px patches, merged 2×2, CLIP's normalisation (the published defaults)
    "qwen2_5_vl": dict(patch_size=14, merge_size=2, temporal_patch_size=2,
                       size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}),
    # Qwen3-VL: 16-px patches, merged 2×2, normalised to [-1, 1]
    "qwen3_vl": dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                     size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 64}),
}


def build_config(family: str, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in
           ("image_pad", "video_pad", "vision_start", "vision_end")}
    common = dict(image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                  vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                  tie_word_embeddings=True)
    text = dict(TEXT, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  patch_size=IMAGE_PROCESSOR[family]["patch_size"], spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":  # its vision width is `embed_dim`, its output width `hidden_size`
        return Qwen2VLConfig(
            text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": MROPE}),
            vision_config=dict(depth=2, embed_dim=64, hidden_size=TEXT["hidden_size"], mlp_ratio=2, num_heads=2,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2), **common)
    if family == "qwen2_5_vl":
        return Qwen2_5_VLConfig(
            text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": MROPE}),
            vision_config=dict(vision, window_size=56, fullatt_block_indexes=[1]), **common)
    if family == "qwen3_vl":
        return Qwen3VLConfig(
            text_config=dict(text, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": MROPE,
                                                                 "mrope_interleaved": True}),
            vision_config=dict(vision, num_position_embeddings=64, deepstack_visual_indexes=[0]), **common)
    raise ValueError(f"no tiny model for {family!r}; choose one of {FAMILIES}")


def save_qwen_vl(path: str | Path, family: str, seed: int = 0) -> Path:
    """Write a randomly initialised tiny model of `family` (model, tokenizer, image processor)."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.policy.templates import build_tokenizer

    path = Path(path)
    tokenizer = build_tokenizer("qwen2.5-vl")
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(build_config(family, tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR[family]).save_pretrained(path)
    return path
