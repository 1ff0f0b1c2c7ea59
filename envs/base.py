"""The environment contract: chat messages of text and images.

An environment speaks chat messages, never tokens: `reset` returns the opening
messages, `step` takes the model's raw text and returns the messages to append.
Rewards are verifiable. Any text is a legal action: what cannot be parsed is a
wasted move with an observation that says so, never an exception, because model
output is untrusted input.

Observations are tuples of `{"role", "content"}` dicts (Gymnasium's `Sequence`
space holds tuples). Content is either text without control characters, at most
`MAX_TEXT` characters, or a tuple of parts in the Hugging Face chat-template
format, `{"type": "text", "text": str}` and `{"type": "image", "image": array}`,
whose texts together hold at most `MAX_TEXT` characters. There is one image type:
a numpy uint8 array of shape (H, W, 3), RGB, 1 <= H, W <= `MAX_IMAGE_SIDE`, at
most `MAX_IMAGES` of them per message; `messages` copies each into a read-only
C-contiguous array, so later changes by the environment cannot reach a recorded
episode. One type, checked here, keeps every engine and the wire free of format
guessing; anything else is refused with what to pass instead. The base class
enforces all of it, so `gymnasium.utils.env_checker.check_env` passes for every
subclass and an environment cannot flood the context by accident.

Tool-call mode (envs/tools.py): an environment that declares `tools` is stepped with a
`ToolTurn` (the turn's text and its parsed calls) instead of the text, and answers calls with
`tool` messages (`run_tools`); the chat template renders the tools and the model's calls are
parsed in its family's format, so the environment still never sees tokens.

Each turn's state: an environment may name the state a turn is played from with a string
under `info["state"]` (`STATE`) in what `reset` and `step` return, e.g. the agent's cell in a
maze. Estimators that compare turns played from the same state (`--learner.step-weight`,
GiGPO's step-level groups) group by it; without it a turn's state is its observation as
rendered (tokens and pixels), so states are the same only where the observations are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np

from envs.tools import MAX_CALLS, Tool, ToolError, ToolTurn

T = TypeVar("T")

Part = dict[str, Any]
"""`{"type": "text", "text": str}` or `{"type": "image", "image": np.ndarray}`."""
Content = str | tuple[Part, ...]
Messages = tuple[dict[str, Content], ...]

# Observations and actions are free text; the spaces bound their length so that
# gymnasium's checker and users can see what an environment accepts.
MAX_TEXT = 4096
_TRUNCATED = "\n[truncated]"

MAX_IMAGES = 8
"""Images in one message at most."""
MAX_IMAGE_SIDE = 1024
"""Pixels on an image's longer side at most."""

_IMAGE = "a numpy uint8 array of shape (H, W, 3), RGB"
_PARTS = "{'type': 'text', 'text': str} or {'type': 'image', 'image': np.ndarray}"


def _control(c: str) -> bool:
    return (ord(c) < 32 and c not in "\n\t") or 127 <= ord(c) < 160


class TextSpace(gym.spaces.Text):
    """Any text of at most `max_length` characters without control characters (newlines and
    tabs allowed). Samples are printable ASCII; membership takes any Unicode, as models write it."""

    def __init__(self, max_length: int = MAX_TEXT) -> None:
        super().__init__(max_length=max_length, min_length=0,
                         charset="".join(chr(c) for c in range(32, 127)) + "\n")

    def contains(self, x) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length and not any(_control(c) for c in x)


def text_space(max_length: int = MAX_TEXT) -> TextSpace:
    return TextSpace(max_length)


def clean_text(text: str, limit: int = MAX_TEXT) -> str:
    """`text` inside the observation space: control characters dropped (newlines and tabs
    kept, "\\r\\n" as "\\n") and at most `limit` characters (the end replaced by a marker)."""
    text = text.replace("\r\n", "\n")
    if any(_control(c) for c in text):
        text = "".join(c for c in text if not _control(c))
    return text if len(text) <= limit else text[: limit - len(_TRUNCATED)] + _TRUNCATED


def _image_error(x: Any) -> Exception | None:
    """What is wrong with `x` as an image, as the exception to raise, or None."""
    if not isinstance(x, np.ndarray):
        kind = "a PIL image" if hasattr(x, "convert") and hasattr(x, "mode") else type(x).__name__
        return TypeError(f"an image must be {_IMAGE}, got {kind}: convert a PIL image with "
                         "np.asarray(img.convert('RGB')), other pixel data with np.asarray(x, np.uint8)")
    if x.dtype != np.uint8:
        return TypeError(f"an image must be {_IMAGE}, got dtype {x.dtype}: pass values 0-255 as "
                         "np.clip(x, 0, 255).astype(np.uint8) (floats in [0, 1] times 255 first)")
    if x.ndim != 3 or x.shape[2] != 3:
        return ValueError(f"an image must be {_IMAGE}, got shape {x.shape}: grey (H, W) as "
                          "np.repeat(x[..., None], 3, axis=2), RGBA (H, W, 4) as x[..., :3], "
                          "channels first (3, H, W) as x.transpose(1, 2, 0)")
    if min(x.shape[:2]) < 1:
        return ValueError(f"an image must have at least one pixel on each side, got shape {x.shape}")
    if max(x.shape[:2]) > MAX_IMAGE_SIDE:
        return ValueError(f"an image is at most MAX_IMAGE_SIDE = {MAX_IMAGE_SIDE} pixels a side, got "
                          f"shape {x.shape}: downscale it")
    return None


def _parts(content: list | tuple, copy: bool, limit: int = MAX_TEXT) -> tuple[Part, ...]:
    """`content` as a tuple of valid parts: texts cleaned and together at most `limit`
    characters, images checked and, with `copy`, copied read-only. TypeError or ValueError
    says what is wrong."""
    out: list[Part] = []
    budget, images = limit, 0
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise TypeError(f"content part {i} must be a dict, {_PARTS}; got {type(part).__name__}")
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in ("text", "image"):
            raise ValueError(f"content part {i} has type {kind!r}: a part is {_PARTS}")
        if part.keys() != {"type", kind}:
            raise ValueError(f"content part {i} must have exactly the keys 'type' and {kind!r}, got "
                             f"{list(part)}: a part is {_PARTS}")
        if kind == "text":
            if not isinstance(part["text"], str):
                raise TypeError(f"content part {i}: 'text' must be a str, got {type(part['text']).__name__}")
            text = clean_text(part["text"], max(budget, len(_TRUNCATED)))[:budget]
            budget -= len(text)
            out.append({"type": "text", "text": text})
            continue
        images += 1
        if images > MAX_IMAGES:
            raise ValueError(f"a message holds at most MAX_IMAGES = {MAX_IMAGES} images, part {i} is image "
                             f"{images}: spread them over several messages")
        if (error := _image_error(part["image"])) is not None:
            raise type(error)(f"content part {i}: {error}")
        image = part["image"]
        if copy:
            image = np.array(image, order="C")
            image.flags.writeable = False
        out.append({"type": "image", "image": image})
    return tuple(out)


class ContentSpace(gym.Space):
    """A message's content: text as in `TextSpace`, or a tuple of text and image parts as
    `messages` makes them (see the module docstring). Samples are text only."""

    def __init__(self, max_length: int = MAX_TEXT) -> None:
        super().__init__()
        self.text = TextSpace(max_length)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def seed(self, seed: int | None = None) -> int:
        return self.text.seed(seed)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return self.text.sample(mask, probability)

    def contains(self, x: Any) -> bool:
        if isinstance(x, str):
            return self.text.contains(x)
        if not isinstance(x, tuple):
            return False
        try:
            parts = _parts(x, copy=False, limit=self.text.max_length)
        except (TypeError, ValueError):
            return False
        return all(p["type"] == "image" or p["text"] == q["text"] for p, q in zip(parts, x))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ContentSpace) and self.text == other.text

    def __repr__(self) -> str:
        return f"ContentSpace(max_length={self.text.max_length}, max_images={MAX_IMAGES})"


def content_text(content: Content) -> str:
    """The text of a message's content: the string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p["type"] == "text")


def content_images(content: Content) -> list[np.ndarray]:
    """The images of a message's content, in order (none for a string)."""
    if isinstance(content, str):
        return []
    return [p["image"] for p in content if p["type"] == "image"]


def messages(content: str | list | tuple) -> Messages:
    """A string (one user message) or a list of chat messages as a valid observation. A message's
    content is a string or a list of parts (see the module docstring); anything else is a
    TypeError or ValueError that says what to pass instead."""
    if isinstance(content, str):
        content = [{"role": "user", "content": content}]
    out = []
    for m in content:
        if not isinstance(m, dict) or "content" not in m:
            hint = (": wrap content parts in a message, [{'role': 'user', 'content': parts}]"
                    if isinstance(m, dict) and "type" in m else "")
            raise TypeError(f"an observation message must be a dict with a 'content', got {m!r:.200}{hint}")
        body = m["content"]
        if isinstance(body, str):
            body = clean_text(body)
        elif isinstance(body, (list, tuple)):
            body = _parts(body, copy=True)
        else:
            raise TypeError(f"a message's content must be a str or a list of parts, {_PARTS}; "
                            f"got {type(body).__name__}")
        out.append({"role": clean_text(str(m.get("role", "user")), 16), "content": body})
    return tuple(out)


def distinct_tasks(draw: Callable[[np.random.Generator], T], seed: int, n: int,
                   key: Callable[[T], str] = lambda task: task.key()) -> list[T]:
    """The first `n` distinct tasks (by `key`) that `draw` makes from a generator seeded with
    `seed`: how every environment builds its fixed evaluation set."""
    rng = np.random.default_rng(seed)
    out: dict[str, T] = {}
    while len(out) < n:
        task = draw(rng)
        out.setdefault(key(task), task)
    return list(out.values())


STATE = "state"
"""The `info` key under which an environment names the state of the next turn (a string)."""
MAX_STATE = 1024
"""Longest `info["state"]`, in characters."""


def checked_info(info: Any) -> Any:
    """`info` unchanged; ValueError if it names a state (`STATE`) that is not a string of at most
    `MAX_STATE` characters."""
    state = info.get(STATE) if isinstance(info, dict) else None
    if state is not None and not (isinstance(state, str) and len(state) <= MAX_STATE):
        raise ValueError(f"info[{STATE!r}] names the next turn's state as a string of at most {MAX_STATE} "
                         f"characters, got {type(state).__name__} {str(state)[:60]!r}")
    return info


class TextEnv(gym.Env):
    """A multi-turn text environment on the Gymnasium API.

    Usage loop (what an actor does for each episode)::

        messages, info = env.reset(seed=7)
        messages = list(messages)
        while True:
            text = policy(messages)                 # the model's raw answer
            obs, reward, terminated, truncated, info = env.step(text)
            messages += [{"role": "assistant", "content": text}, *obs]
            if terminated or truncated:
                break

    In tool-call mode (`tools` not empty) `step` takes a `ToolTurn` (a plain string is a turn
    without calls) and `_step` is handed that `ToolTurn`; `run_tools` answers its calls through
    `call_tool`.

    Subclasses implement `_reset(options) -> (observation, info)` and
    `_step(text) -> (observation, reward, terminated, truncated, info)`, where an
    observation is a string (one user message) or a list of chat messages, each
    message's content a string or a list of text and image parts. Draw
    randomness from `self.np_random`, which `reset(seed=...)` seeds, so that a
    seed alone decides the task. This base turns observations into the space's
    form and caps the action's length.
    """

    metadata = {"render_modes": []}

    max_action_chars: int = MAX_TEXT
    """Longer model output is cut to this many characters before `_step` sees it."""

    shows_images: bool = False
    """Whether observations hold images (the launcher refuses a text model for such an environment)."""

    tools: tuple[Tool, ...] = ()
    """The tools of tool-call mode (empty: the model's text is the action)."""

    def __init__(self) -> None:
        message = gym.spaces.Dict({"role": text_space(16), "content": ContentSpace()})
        self.observation_space = gym.spaces.Sequence(message)
        self.action_space = text_space()

    # -- to implement -----------------------------------------------------
    def _reset(self, options: dict[str, Any]) -> tuple[str | list, dict[str, Any]]:
        raise NotImplementedError

    def _step(self, text: str) -> tuple[str | list, float, bool, bool, dict[str, Any]]:
        raise NotImplementedError

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """The result of one call of a declared tool, its arguments checked against its schema;
        raise ToolError for a call the tool cannot do (the model reads its message)."""
        raise NotImplementedError(f"{type(self).__name__} declares tools but does not implement call_tool")

    def run_tools(self, turn: ToolTurn) -> list[dict[str, str]]:
        """One `tool` message for each call of `turn`, in order: its result, or what was wrong with
        it (unreadable, an unknown tool, arguments that do not fit, a ToolError)."""
        by_name = {t.name: t for t in self.tools}
        out = []
        for call in turn.calls[:MAX_CALLS]:
            tool = by_name.get(call.name)
            if call.error:
                result = f"error: {call.error}"
            elif tool is None:
                result = f"error: there is no tool {call.name!r:.60}; the tools are {', '.join(by_name)}"
            elif (wrong := tool.check(call.arguments)) is not None:
                result = f"error: {wrong}"
            else:
                try:
                    result = self.call_tool(call.name, call.arguments)
                except ToolError as exc:
                    result = f"error: {exc}"
            out.append({"role": "tool", "content": result})
        if len(turn.calls) > MAX_CALLS:
            out.append({"role": "tool", "content": f"error: at most {MAX_CALLS} tool calls a turn; "
                                                   f"{len(turn.calls) - MAX_CALLS} more were not run"})
        return out

    eval_seed: int = 0
    """The seed of this environment's fixed evaluation set."""

    def eval_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        """`n` fixed evaluation tasks drawn from `seed`, as `reset` options.
        Training resets (by seed) must never produce one of the set for `eval_seed`."""
        raise NotImplementedError(f"{type(self).__name__} has no evaluation set")

    # -- Gymnasium API ----------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        obs, info = self._reset(dict(options or {}))
        return messages(obs), checked_info(info)

    def step(self, action: str | ToolTurn):
        if isinstance(action, ToolTurn):
            if not self.tools:
                raise TypeError(f"{type(self).__name__} declares no tools: step it with the model's text (str), "
                                "not a ToolTurn")
            action = ToolTurn(action.text[: self.max_action_chars], action.calls)
        elif isinstance(action, str):
            action = action[: self.max_action_chars]
            if self.tools:
                action = ToolTurn(action)
        else:
            raise TypeError(f"action must be the model's text (str), or a ToolTurn in tool-call mode, got "
                            f"{type(action).__name__}")
        obs, reward, terminated, truncated, info = self._step(action)
        return messages(obs), float(reward), bool(terminated), bool(truncated), checked_info(info)
