"""The built-in tiny policy: a small Llama decoder and a tokenizer made locally.

It is a standard transformers architecture saved in Hugging Face format, so the
code that loads it is the code that loads real checkpoints, and vLLM could serve
it. The tokenizer is built with the `tokenizers` library (nothing downloaded):
one token per printable character, plus whole-word tokens for the chat roles and
the maze vocabulary, plus ChatML-style turn markers and a chat template.
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


def build_tokenizer():
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
    return fast


def build_model(tokenizer, hidden: int = 128, layers: int = 4, heads: int = 4, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Llama rather than Qwen2: transformers maps the qwen2 model type to its own
    # byte-level tokenizer class and would ignore ours.
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, use_cache=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


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
