"""Chat rendering, token in and token out.

An episode's tokens are built turn by turn and never re-tokenised: the prompt
(the template applied to the opening messages, with the generation prompt), the
model's own sampled tokens ending with the end-of-turn token, the tokens of the
next observation, the model's tokens again, and so on. The learner trains on
exactly these tokens.

Design decisions:

- **End of turn from the template.** The token that closes an assistant turn is
  read off the template itself (render a conversation ending with an assistant
  message and take the special token right after its content): `<|im_end|>` for
  Qwen, `<|eot_id|>` for Llama 3, whatever the tokenizer's eos is (Llama 3 base
  configs say `<|end_of_text|>`, some Qwen configs `<|endoftext|>`). The engine
  stops on it (and on eos); it is `stop_ids[0]`, and `closing` appends it after
  a turn that did not end with it (cut by `max_new_tokens`), so the observation
  always follows the token the template puts before it.
- **An observation is what the template appends after an assistant's
  end-of-turn token.** Its tokens are taken from the template applied to a fixed
  base conversation (user "hi", assistant "Answer 0.") followed by the new messages,
  with the generation prompt: everything after the base assistant's end-of-turn
  token (the approach of SkyRL and verl, cut at the end-of-turn token rather than
  at the end of the rendered base). So what a template does *inside* earlier
  assistant turns does not matter: Qwen3 renders the last assistant turn with a
  `<think>` block and earlier ones without it, but the model's own tokens are
  never re-rendered. Cutting the token ids (not the text) at a special token
  keeps the observation's tokens exactly those of the full rendering.
- **Checked at construction.** A template that cannot be rendered turn by turn
  raises `ValueError` when `Chat` is built (so a run stops at start, not episode
  by episode): no chat template; no special token closing the assistant's
  content; a generation prompt that is not appended after the conversation;
  earlier messages rendered differently once the conversation grows (say, a
  turn count in the system header); an observation whose tokens depend on the
  conversation before it. Sample episodes of three turns are rendered with and
  without a system message, with user and tool observations and with an
  observation of two messages. A template that refuses the system or tool role
  outright (it raises) is accepted: it fails only environments that send them.
- **Images.** With a vision-language model's image scheme (policy/vision.py), a message's
  content may be a list of text and image parts; the template renders one placeholder per
  image and `prompt_ids` / `observation_ids` return it expanded (`vision.expand`), so the
  episode's tokens are those the model sees. The checks at construction then also render
  episodes whose observations hold pictures.
- **Tools.** With `tools` (JSON schemas in the OpenAI function format), every rendering passes
  them to the template (`apply_chat_template(tools=...)`), so the prompt declares them as the
  model was trained to see them, and the checks at construction run with them. `parse_tools`
  reads a model turn's calls with the parser of the template's family (policy/tools.py), named
  by `tool_format` or detected from the template; a template that ignores the tools, or whose
  format is unknown, raises `ValueError` at construction.
- **Generation prompt as the template renders it.** `template_kwargs` go to
  every rendering (e.g. `{"enable_thinking": False}` for Qwen3); by default none,
  so Qwen3 thinks: its generation prompt is `<|im_start|>assistant\\n` and the
  model writes its own `<think>...</think>` block. With `enable_thinking=False`
  the generation prompt carries the empty `<think>\\n\\n</think>\\n\\n`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

_BASE = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "Answer 0."})
_PROBE = "Probe answer 7."
_TURNS = 3
"""Turns of each sample episode checked at construction."""


def _m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


# (what a sample exercises, its opening, its observation at turn k, the roles it needs beyond user and
# assistant: none for the sample every template must render, else those refused when it cannot)
_SAMPLES: tuple[tuple[str, list[dict], Callable[[int], list[dict]], tuple[str, ...]], ...] = (
    ("user observations", [_m("user", "Question one?")], lambda k: [_m("user", f"Observation {k}.")], ()),
    ("a system message", [_m("system", "Be brief."), _m("user", "Question one?")],
     lambda k: [_m("user", f"Observation {k}.")], ("system",)),
    ("tool observations", [_m("user", "Question one?")], lambda k: [_m("tool", f"result {k}")], ("tool",)),
    ("two-message observations", [_m("system", "Be brief."), _m("user", "Question one?")],
     lambda k: [_m("tool", f"result {k}"), _m("user", f"Then {k}?")], ("system", "tool")),
)


_PICTURE = np.full((8, 8, 3), 200, dtype=np.uint8)


def _pictured(role: str, text: str) -> dict:
    return {"role": role, "content": [{"type": "text", "text": text}, {"type": "image", "image": _PICTURE}]}


_IMAGE_SAMPLES = (
    ("image observations", [_pictured("user", "Question one?")], lambda k: [_pictured("user", f"Observation {k}.")],
     ()),
)


def _texts(message: dict) -> list[str]:
    """The text pieces of a message's content (a string, or text parts beside images)."""
    content = message["content"]
    if isinstance(content, str):
        return [content]
    return [part["text"] for part in content if part.get("type") == "text"]


def message_images(messages) -> list[np.ndarray]:
    """The images of `messages`, in the order their placeholders are rendered."""
    return [part["image"] for m in messages if not isinstance(m["content"], str)
            for part in m["content"] if part.get("type") == "image"]


class Chat:
    """Renders an episode's messages to tokens, turn by turn.

    Usage::

        chat = Chat(tokenizer)                        # ValueError: template not incremental
        tokens = chat.prompt_ids(opening_messages)    # then the engine samples, stopping on chat.stop_ids
        tokens += model_tokens + chat.closing(model_tokens)
        tokens += chat.observation_ids(observation)   # and so on, turn after turn
    """

    def __init__(self, tokenizer, template_kwargs: dict | None = None, scheme=None,
                 tools: Sequence[dict] | None = None, tool_format: str = "auto") -> None:
        """`scheme`: the image scheme of a vision-language model (policy/vision.py `scheme_for`);
        `tools`: the environment's tools in tool-call mode (`Tool.schema()` of each), and
        `tool_format` the name of their parser in policy/tools.py FORMATS, or "auto"."""
        self.tokenizer = tokenizer
        self.scheme = scheme
        self.template_kwargs = dict(template_kwargs or {})
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {self.name} has no chat template: Tandem renders episodes with it. "
                "Use an instruct/chat checkpoint, or set tokenizer.chat_template (chat_template.jinja in "
                "the model folder)")
        self.tools: list[dict] = [dict(t) for t in tools or ()]
        """The tools every rendering declares (empty: none, the model's text is the action)."""
        self.tool_format = self._find_tool_format(tool_format) if self.tools else ""
        self.end_of_turn, self._eot_text = self._find_end_of_turn()
        eos = tokenizer.eos_token_id
        self.stop_ids: tuple[int, ...] = (self.end_of_turn,) + (
            (eos,) if eos is not None and eos != self.end_of_turn else ())
        """Tokens the engine stops on: the end-of-turn token first, then eos if it differs."""
        self.skipped: list[str] = []
        """Sample episodes the template refused to render (roles it does not support) or cannot
        render turn by turn."""
        self.refused: dict[str, str] = {}
        """Roles the template cannot render turn by turn, with why: an episode whose messages hold
        one raises ValueError (say, a system message folded into the last user turn)."""
        self._check_incremental()

    # -- rendering --------------------------------------------------------------
    def _text(self, messages, generation_prompt: bool, tools: bool = True) -> str:
        extra = {"tools": self.tools} if self.tools and tools else {}
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False, **self.template_kwargs, **extra)

    def _ids(self, text: str) -> list[int]:
        # what apply_chat_template(tokenize=True) does: the template writes the special tokens
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages, generation_prompt: bool) -> list[int]:
        return self._ids(self._text(messages, generation_prompt))

    def _after_turn(self, history: Sequence[dict], new: Sequence[dict]) -> list[int]:
        """Tokens the template appends after the end-of-turn token of `history`'s last message
        (an assistant turn): the `new` messages and the generation prompt."""
        content = history[-1]["content"]
        text = self._text(list(history) + list(new), generation_prompt=True)
        at = text.find(content + self._eot_text)
        if at < 0:
            raise ValueError(
                f"the chat template of {self.name} does not close an assistant turn with "
                f"{self._eot_text!r} right after its content when more messages follow it")
        before = text.count(self._eot_text, 0, at + len(content))
        ids = self._ids(text)
        ends = [i for i, t in enumerate(ids) if t == self.end_of_turn]
        if len(ends) != text.count(self._eot_text):
            raise ValueError(
                f"the tokenizer of {self.name} does not turn every {self._eot_text!r} of the rendered chat "
                "into its single token (check the added token's lstrip/rstrip/normalized settings)")
        return ids[ends[before] + 1:]

    # -- the interface --------------------------------------------------------
    def prompt_ids(self, messages) -> list[int]:
        """Tokens of the opening messages followed by the assistant's generation prompt (images
        expanded; VisionError when they do not fit the model)."""
        self._check_roles(messages)
        return self._expanded(self._render(list(messages), generation_prompt=True), messages)

    def observation_ids(self, messages) -> list[int]:
        """Tokens to append after a model turn that ended with the end-of-turn token: the new
        messages and the next generation prompt, exactly as the template renders them there."""
        self._check_roles(messages)
        return self._expanded(self._after_turn(_BASE, list(messages)), messages)

    def _check_roles(self, messages) -> None:
        for m in messages:
            if m["role"] in self.refused:
                raise ValueError(f"the chat template of {self.name} cannot render messages of role {m['role']!r} "
                                 f"turn by turn, so episodes that hold one cannot be played with it (use an "
                                 f"environment that sends none): {self.refused[m['role']]}")

    def _expanded(self, ids: list[int], messages) -> list[int]:
        from policy.vision import VisionError, expand

        images = message_images(messages)
        if self.scheme is None:
            if images:
                raise VisionError(f"{self.name} is a text model: it cannot see the images of these messages "
                                  "(use a vision-language model, e.g. --model builtin:vlm)")
            return ids
        return expand(self.scheme, ids, images)

    def closing(self, turn: Sequence[int]) -> list[int]:
        """What to append after a model turn before the next observation: nothing when the turn
        ended with the end-of-turn token, else that token (a turn cut by max_new_tokens, or one
        that ended on eos), so the observation follows what the template puts before it."""
        return [] if turn and turn[-1] == self.end_of_turn else [self.end_of_turn]

    def decode(self, ids: list[int]) -> str:
        """The text of a model turn, stop tokens removed."""
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=True)

    def parse_tools(self, text: str):
        """(the text outside the calls, the calls) of a model turn's text, read in the template's
        tool-call format (policy/tools.py: a call that cannot be read has `error` set)."""
        from policy.tools import FORMATS

        assert self.tools, "parse_tools is for a Chat built with tools"
        return FORMATS[self.tool_format](text)

    def _find_tool_format(self, tool_format: str) -> str:
        from policy.tools import FORMATS, detect_format

        if tool_format != "auto" and tool_format not in FORMATS:
            raise ValueError(f"unknown tool-call format {tool_format!r}; choose one of auto, {', '.join(FORMATS)}")
        probe = [_m("user", "Hello.")]
        try:
            with_tools, without = self._text(probe, True), self._text(probe, True, tools=False)
        except Exception as exc:
            raise ValueError(f"the chat template of {self.name} cannot render the environment's tools: {exc}") from exc
        if with_tools == without:
            raise ValueError(f"the chat template of {self.name} ignores tools (apply_chat_template(tools=...) renders "
                             "nothing of them), so the model would never see the environment's tools: use a model "
                             "whose template declares tools (Qwen2.5, Qwen3, Llama 3.1 instruct), or run the "
                             "environment without tool calls")
        found = tool_format if tool_format != "auto" else detect_format(str(self.tokenizer.chat_template))
        if found is None:
            raise ValueError(f"the tool-call format of the chat template of {self.name} is not one Tandem "
                             f"recognises: name it with --tool-format ({', '.join(FORMATS)}), or add its parser "
                             "to policy/tools.py FORMATS")
        return found

    # -- checks at construction ---------------------------------------------------
    def _find_end_of_turn(self) -> tuple[int, str]:
        try:
            text = self._text([_m("user", "Hello."), _m("assistant", _PROBE)], generation_prompt=False)
        except Exception as exc:
            raise ValueError(f"the chat template of {self.name} cannot render a user message followed by "
                             f"an assistant message: {exc}") from exc
        at = text.find(_PROBE)
        if at < 0:
            raise ValueError(f"the chat template of {self.name} drops the content of an assistant message, "
                             "so the model's turns cannot be rendered")
        rest = text[at + len(_PROBE):]
        added = {tok.content: i for i, tok in self.tokenizer.added_tokens_decoder.items() if tok.content}
        found = [c for c in added if rest.startswith(c)]
        if not found:
            raise ValueError(
                f"the chat template of {self.name} does not close the assistant's content with a special "
                f"token (it renders {rest[:40]!r} after it): Tandem needs one to end a model turn, like "
                "<|im_end|> or <|eot_id|>. Use a template that ends each assistant turn with a special token")
        text_eot = max(found, key=len)
        return added[text_eot], text_eot

    def _check_incremental(self) -> None:
        cleared: set[str] = set()  # roles whose own sample passed
        for what, opening, observe, roles in _SAMPLES + (_IMAGE_SAMPLES if self.scheme is not None else ()):
            episode = list(opening)
            for k in range(1, _TURNS + 1):
                episode += [_m("assistant", f"Answer {k}."), *observe(k)]
            try:
                text = self._text(episode, generation_prompt=True)
            except Exception as exc:
                if not roles:
                    raise ValueError(f"the chat template of {self.name} cannot render a conversation of "
                                     f"user and assistant messages: {exc}") from exc
                self.skipped.append(f"{what}: {exc}")
                continue
            dropped = sorted({m["role"] for m in episode if any(t not in text for t in _texts(m))})
            if dropped:
                why = f"the template leaves messages of role {', '.join(map(repr, dropped))} out of the conversation"
                if not roles or not set(dropped) <= set(roles):
                    raise ValueError(f"the chat template of {self.name}: {why} (episode with {what})")
                self.skipped.append(f"{what}: {why}")
                for role in dropped:
                    self.refused.setdefault(role, why)
                continue
            try:
                self._check_episode(what, list(opening), observe)
            except ValueError as exc:
                if not roles:
                    raise
                self.skipped.append(f"{what}: {exc}")
                for role in [r for r in roles if r not in cleared] or roles:
                    self.refused.setdefault(role, str(exc))
                continue
            cleared.update(roles)

    def _check_episode(self, what: str, history: list[dict], observe: Callable[[int], list[dict]]) -> None:
        """Build a sample episode as the actor does and hold each turn against the template's own
        rendering. What decides is what the engine sees: the prompt with its generation prompt, and
        the conversation with the model's turn closed and the next observation, which must agree up
        to where the model's answer begins (a block the generation prompt adds inside the turn, like
        Qwen3's empty think block, stays in the episode as prompted). The rendering without a
        generation prompt does not matter: some templates end it with eos."""
        fix = ("Tandem appends each turn's tokens to the episode and never re-renders earlier ones; use a "
               "template that renders a conversation's earlier messages the same whatever follows them")
        for k in range(1, _TURNS + 1):
            prompt_text = self._text(history, True)
            prompt = self._ids(prompt_text)
            answer, obs = _m("assistant", f"Answer {k}."), observe(k)
            text = self._text(history + [answer, *obs], generation_prompt=True)
            grown = self._ids(text)
            agree = next((i for i, (a, b) in enumerate(zip(prompt, grown)) if a != b), min(len(prompt), len(grown)))
            at = text.find(answer["content"] + self._eot_text)
            begins = self._token_at(text, at)
            spaced = text.startswith(prompt_text) and not text[len(prompt_text):at].strip(" ")
            if agree == len(prompt) and spaced:
                begins = agree  # the model writes the space the template puts before its answer (Mistral)
            elif agree < begins and agree == len(prompt):
                raise ValueError(
                    f"the chat template of {self.name} does not render a conversation with the generation "
                    f"prompt as the conversation followed by the assistant's header (episode with {what}, turn "
                    f"{k}): it renders {self.tokenizer.decode(grown[agree:begins])!r} after the prompt, before "
                    "the model's answer, so the model would be prompted with tokens the episode does not hold. "
                    "Use a template whose add_generation_prompt appends the assistant's header (or nothing, "
                    "when the model writes right after the user's turn)")
            if agree != begins:
                raise ValueError(
                    f"the chat template of {self.name} is not prefix-stable: in an episode with {what}, "
                    f"turn {k}, the prompt renders as {self.tokenizer.decode(prompt[agree:agree + 12])!r}... but "
                    f"as {self.tokenizer.decode(grown[agree:agree + 12])!r}... once the model's turn and the "
                    f"next message follow. {fix}")
            end = grown.index(self.end_of_turn, begins)
            if grown[end + 1:] != self._after_turn(_BASE, obs):
                raise ValueError(
                    f"the chat template of {self.name} renders an observation differently depending on the "
                    f"conversation before it (episode with {what}, turn {k}), so its tokens cannot be "
                    f"computed turn by turn. {fix}")
            history += [answer, *obs]

    def _token_at(self, text: str, at: int) -> int:
        """Index of the token of `text` that holds its character `at`."""
        assert at >= 0, "the sample answer is in its own rendering"
        try:
            offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        except NotImplementedError:  # a slow tokenizer: count the tokens before (a space joins the word)
            return len(self._ids(text[:at].rstrip(" ")))
        return next(i for i, (_, stop) in enumerate(offsets) if stop > at)
