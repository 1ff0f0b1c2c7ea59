"""The text-environment contract.

An environment speaks chat messages, never tokens: `reset` returns the opening
messages, `step` takes the model's raw text and returns the messages to append.
Rewards are verifiable. Any text is a legal action: what cannot be parsed is a
wasted move with an observation that says so, never an exception, because model
output is untrusted input.

Observations are tuples of `{"role", "content"}` dicts (Gymnasium's `Sequence`
space holds tuples) whose content is any text without control characters, at
most `MAX_TEXT` characters: the base class enforces both, so
`gymnasium.utils.env_checker.check_env` passes for every subclass and an
environment cannot flood the context by accident.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np

T = TypeVar("T")

Messages = tuple[dict[str, str], ...]

# Observations and actions are free text; the spaces bound their length so that
# gymnasium's checker and users can see what an environment accepts.
MAX_TEXT = 4096
_TRUNCATED = "\n[truncated]"


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


def messages(content: str | list | tuple) -> Messages:
    """A string (one user message) or a list of chat messages as a valid observation."""
    if isinstance(content, str):
        content = [{"role": "user", "content": content}]
    out = []
    for m in content:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise TypeError(f"an observation message must be a dict with a 'content' string, got {m!r}")
        role = str(m.get("role", "user"))
        out.append({"role": clean_text(role, 16), "content": clean_text(m["content"])})
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

    Subclasses implement `_reset(options) -> (observation, info)` and
    `_step(text) -> (observation, reward, terminated, truncated, info)`, where an
    observation is a string (one user message) or a list of chat messages. Draw
    randomness from `self.np_random`, which `reset(seed=...)` seeds, so that a
    seed alone decides the task. This base turns observations into the space's
    form and caps the action's length.
    """

    metadata = {"render_modes": []}

    max_action_chars: int = MAX_TEXT
    """Longer model output is cut to this many characters before `_step` sees it."""

    def __init__(self) -> None:
        message = gym.spaces.Dict({"role": text_space(16), "content": text_space()})
        self.observation_space = gym.spaces.Sequence(message)
        self.action_space = text_space()

    # -- to implement -----------------------------------------------------
    def _reset(self, options: dict[str, Any]) -> tuple[str | list, dict[str, Any]]:
        raise NotImplementedError

    def _step(self, text: str) -> tuple[str | list, float, bool, bool, dict[str, Any]]:
        raise NotImplementedError

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
        return messages(obs), info

    def step(self, action: str):
        if not isinstance(action, str):
            raise TypeError(f"action must be the model's text (str), got {type(action).__name__}")
        obs, reward, terminated, truncated, info = self._step(action[: self.max_action_chars])
        return messages(obs), float(reward), bool(terminated), bool(truncated), info
