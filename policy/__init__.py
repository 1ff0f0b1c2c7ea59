"""The policy definition shared by actors and learners.

Loading a model and its tokenizer (a Hugging Face path or id, or the built-in
tiny model), the LoRA configuration, and the chat rendering that turns
environment messages into tokens. Actors and learners both import this; neither
imports the other.
"""

from policy.chat import Chat
from policy.load import BUILTIN, LoraSpec, load_model, load_tokenizer, resolve_model

__all__ = ["BUILTIN", "Chat", "LoraSpec", "load_model", "load_tokenizer", "resolve_model"]
