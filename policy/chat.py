"""Chat rendering, token in and token out.

The first turn is the chat template applied to the opening messages with the
generation prompt. Every later observation is rendered as the *difference*
between the template applied to a fixed base conversation with and without the
new messages (the approach SkyRL and verl use), so the tokens appended after
the model's stop token are exactly what the template would produce, and the
model's own tokens are never re-tokenised.
"""

from __future__ import annotations

_BASE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]


class Chat:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token: Tandem needs one to end a model turn")
        self.stop_ids = tuple(sorted({tokenizer.eos_token_id}))
        self._base_ids = self._render(_BASE, generation_prompt=False)

    def _render(self, messages, generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)

    def prompt_ids(self, messages) -> list[int]:
        """Tokens of the opening messages followed by the assistant's generation prompt."""
        return self._render(list(messages), generation_prompt=True)

    def observation_ids(self, messages) -> list[int]:
        """Tokens to append after a model turn: the new messages and the next generation prompt."""
        full = self._render(_BASE + list(messages), generation_prompt=True)
        assert full[: len(self._base_ids)] == self._base_ids, "chat template is not prefix-stable"
        return full[len(self._base_ids):]

    def decode(self, ids: list[int]) -> str:
        """The text of a model turn, stop tokens removed."""
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=True)
