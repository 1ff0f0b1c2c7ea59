"""The built-in tiny policies: a small Llama decoder, and a small Idefics3 vision-language
model around the same decoder, with a tokenizer made locally.

Both are standard transformers architectures saved in Hugging Face format, so the code that
loads them is the code that loads real checkpoints, and vLLM serves them. The tokenizer is
built with the `tokenizers` library (nothing downloaded): one token per printable character,
plus whole-word tokens for the chat roles and the maze vocabulary, plus ChatML-style turn
markers and a chat template. The vision-language model's tokenizer adds Idefics3's image
tokens, and its template renders an image part of a message as `<image>`.

The vision-language model is sized for the image maze: a 64×64 picture (16 px a cell of a
4×4 maze) in patches of 16 px gives 16 image tokens, one a cell (no pixel shuffle); a 4-layer
vision tower of width 128 works out each cell's surroundings, and the text model is the tiny
policy's decoder with 6 layers instead of 4 (~1.84 M parameters in all). Measured: with a
2-layer vision tower of width 64 (patches of 8 px, shuffled by 2) the supervised warm start
stayed at chance on the moves after 140 steps; with the 4-layer decoder its perception stage
took twice the steps and the whole warm start 1.8-2.7 times as long (docs/vision.md).
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "up", "down", "left", "right",
         "start", "moved", "wall", "invalid"]
CHARS = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space, newline

# ChatML without a newline after <|im_end|>, so that the tokens of a turn do not
# depend on what follows it: the actor appends observation tokens right after
# the stop token the model sampled.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
"""Idefics3's image tokens (its processor adds the first three to a tokenizer that lacks them)."""

# The same ChatML, with a message's content either text or a list of text and image parts.
VISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

IMAGE_SIZE = 64
"""Side of the pictures the vision-language model sees (larger ones are resized to it)."""

VISION = {"patch": 16, "scale": 1, "layers": 4, "hidden": 128}
"""The vision tower: patch side (px), pixel-shuffle scale factor, layers and width."""

VLM_TEXT_LAYERS = 6
"""Decoder layers of the built-in vision-language model's text model (the text policy has 4)."""

POSITION_SCALE = 0.3
"""Std of the vision tower's initial position embeddings (`grid_positions`): about that of its
patch embedding's output for pictures in [-1, 1]."""


def build_tokenizer(vision: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(WORDS)  # matched before character splitting: "right" is one token
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>",
        bos_token=None, model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    if vision:
        fast.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
        fast.chat_template = VISION_CHAT_TEMPLATE
    return fast


def llama_config(tokenizer, hidden: int = 128, layers: int = 4, heads: int = 4):
    """The tiny decoder's config (also the vision-language model's text model)."""
    from transformers import LlamaConfig

    # Llama rather than Qwen2: transformers maps the qwen2 model type to its own
    # byte-level tokenizer class and would ignore ours.
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, use_cache=True)


def build_model(tokenizer, hidden: int = 128, layers: int = 4, heads: int = 4, seed: int = 0):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tokenizer, hidden, layers, heads))


def save_tiny(path: str | Path, seed: int = 0) -> Path:
    """Write a randomly initialised tiny policy (model + tokenizer) to `path`."""
    path = Path(path)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def image_seq_len(vision: dict = VISION) -> int:
    """Image tokens per picture: patches over the pixel shuffle's scale factor squared."""
    return (IMAGE_SIZE // vision["patch"]) ** 2 // vision["scale"] ** 2


def build_vlm(tokenizer, hidden: int = 128, layers: int = VLM_TEXT_LAYERS, heads: int = 4, seed: int = 0,
              vision: dict = VISION):
    """The tiny Idefics3: the tiny policy's decoder (`layers` deep) as its text model, a small
    vision tower."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    text = llama_config(tokenizer, hidden, layers, heads).to_dict()
    config = Idefics3Config(
        vision_config=dict(hidden_size=vision["hidden"], intermediate_size=2 * vision["hidden"],
                           num_hidden_layers=vision["layers"], num_attention_heads=4, image_size=IMAGE_SIZE,
                           patch_size=vision["patch"]),
        text_config=text, scale_factor=vision["scale"], image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    # Idefics3 initialises position embeddings at std 0.02, a tenth of what the patch embedding
    # gives the cells' colours, so a tower trained from scratch hardly sees where a patch is;
    # grid positions at the colours' scale let it relate a cell to its neighbours at once.
    embeddings = model.model.vision_model.embeddings
    with torch.no_grad():
        embeddings.position_embedding.weight.copy_(
            grid_positions(IMAGE_SIZE // vision["patch"], vision["hidden"], POSITION_SCALE))
    return model


def grid_positions(side: int, dim: int, scale: float):
    """2-D sine-cosine position embeddings of a side×side grid of patches, [side², dim] (MAE's):
    half the channels encode the row, half the column, each at dim/4 frequencies, scaled to std
    `scale`. A patch's offset to another is then a fixed linear map of its embedding, so attention
    can find "the patch above" from the first step."""
    import torch

    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    freq = 1.0 / 10000 ** (torch.arange(dim // 4) / (dim // 4))  # [dim/4]
    parts = []
    for coord in (rows.reshape(-1), cols.reshape(-1)):
        angle = coord[:, None].float() * freq[None, :]  # [side², dim/4]
        parts += [angle.sin(), angle.cos()]
    table = torch.cat(parts, dim=1)  # [side², dim]
    return table / table.std() * scale


def build_processor(tokenizer, vision: dict = VISION):
    """Idefics3's processor for `IMAGE_SIZE` pictures: one image, no tiles (PIL-based, so no
    torchvision is needed)."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, do_resize=True, size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE})
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                             image_seq_len=image_seq_len(vision), chat_template=tokenizer.chat_template)


def save_tiny_vlm(path: str | Path, seed: int = 0, vision: dict = VISION) -> Path:
    """Write a randomly initialised tiny vision-language policy (model + processor) to `path`."""
    path = Path(path)
    tokenizer = build_tokenizer(vision=True)
    model = build_vlm(tokenizer, seed=seed, vision=vision)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    build_processor(tokenizer, vision).save_pretrained(path)
    return path
