"""The text-environment contract.

An environment speaks chat messages, never tokens: `reset` returns the opening
messages, `step` takes the model's raw text and returns the messages to append.
Rewards are verifiable. Any text is a legal action: what cannot be parsed is a
wasted move with an observation that says so, never an exception, because model
output is untrusted input.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

Messages = list[dict[str, str]]

# Observations and actions are free text; the spaces bound their length so that
# gymnasium's checker and users can see what an environment accepts.
MAX_TEXT = 4096


def text_space(max_length: int = MAX_TEXT) -> gym.spaces.Text:
    charset = "".join(chr(c) for c in range(32, 127)) + "\n"
    return gym.spaces.Text(max_length=max_length, charset=charset)


class TextEnv(gym.Env):
    """A multi-turn text environment on the Gymnasium API.

    Usage loop (what an actor does for each episode)::

        messages, info = env.reset(seed=7)
        while True:
            text = policy(messages)                 # the model's raw answer
            obs, reward, terminated, truncated, info = env.step(text)
            messages += [{"role": "assistant", "content": text}, *obs]
            if terminated or truncated:
                break

    Subclasses implement `_reset(rng, options) -> (str, info)` and
    `_step(text) -> (str, reward, terminated, truncated, info)` on plain
    strings; this base wraps them into chat messages.
    """

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        message = gym.spaces.Dict({"role": text_space(16), "content": text_space()})
        self.observation_space = gym.spaces.Sequence(message)
        self.action_space = text_space()

    # -- to implement -----------------------------------------------------
    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _step(self, text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
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
        text, info = self._reset(dict(options or {}))
        return [{"role": "user", "content": text}], info

    def step(self, action: str):
        if not isinstance(action, str):
            raise TypeError(f"action must be the model's text (str), got {type(action).__name__}")
        text, reward, terminated, truncated, info = self._step(action[:MAX_TEXT])
        return [{"role": "user", "content": text}], float(reward), terminated, truncated, info
