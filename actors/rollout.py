"""Multi-turn rollouts: many episodes at once, one batched generation per turn.

Every episode is played turn by turn: the engine samples the model's turn for
all live episodes in one call, each environment steps on the decoded text, and
the observation is rendered to tokens and appended. What the learner needs is
recorded as it happens: token ids, the behaviour log-prob of every sampled token,
the loss mask (1 on model tokens, 0 on prompt and observation tokens) and the
policy version that produced each model token. The learner trains on exactly
these tokens; nothing is re-tokenised.

`between_turns` is called before every turn: the actor uses it to apply a newer
adapter, so long episodes pick up new weights without restarting.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engine import Engine, SamplingParams
from envs.base import TextEnv
from replay.wire import Trajectory

_ids = itertools.count()


@dataclass
class Episode:
    env: TextEnv
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish_reason: str | None = None
    session: int = field(default_factory=lambda: next(_ids))
    error: str = ""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        self.logprobs, self.mask, self.versions = [0.0] * n, [0] * n, [0] * n

    def append(self, tokens: list[int], trained: bool, version: int, logprobs: list[float] | None = None):
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.mask += [int(trained)] * len(tokens)
        self.versions += [version] * len(tokens)

    def trajectory(self) -> Trajectory:
        assert self.finish_reason is not None, "episode still running"
        return Trajectory(tokens=np.asarray(self.tokens, np.int32), logprobs=np.asarray(self.logprobs, np.float32),
                          mask=np.asarray(self.mask, np.uint8), versions=np.asarray(self.versions, np.int32),
                          reward=self.reward, turns=self.turns, finish_reason=self.finish_reason)


def start(env: TextEnv, chat, seed: int | None = None, options: dict[str, Any] | None = None,
          version: int = 0) -> Episode:
    """Reset `env` and return its episode with the prompt tokens in place."""
    try:
        messages, _ = env.reset(seed=seed, options=options)
        ep = Episode(env=env, tokens=chat.prompt_ids(messages))
    except Exception as exc:  # a broken environment ends the episode, not the actor
        ep = Episode(env=env, tokens=[chat.stop_ids[0]], finish_reason="env_error", error=repr(exc))
    ep.versions = [version] * len(ep.tokens)
    return ep


def play(engine: Engine, chat, episodes: list[Episode], params: SamplingParams, max_tokens: int,
         between_turns: Callable[[], None] | None = None) -> list[Episode]:
    """Run every episode to its end; returns them (finished) in the same order."""
    while True:
        if between_turns is not None:
            between_turns()
        if not turn(engine, chat, episodes, params, max_tokens):
            return episodes


def turn(engine: Engine, chat, episodes: list[Episode], params: SamplingParams, max_tokens: int) -> int:
    """Play one model turn and one environment step for every live episode; returns how many were live."""
    live = [e for e in episodes if e.finish_reason is None]
    if not live:
        return 0
    outs = engine.generate([e.tokens for e in live], params, sessions=[e.session for e in live])
    version = engine.version
    for ep, out in zip(live, outs):
        ep.append(out.tokens, trained=True, version=version, logprobs=out.logprobs)
        ep.turns += 1
        _step(ep, chat, chat.decode(out.tokens), params, max_tokens, version)
    return len(live)


def _step(ep: Episode, chat, text: str, params: SamplingParams, max_tokens: int, version: int) -> None:
    try:
        obs, reward, terminated, truncated, _ = ep.env.step(text)
    except Exception as exc:
        ep.finish_reason, ep.error = "env_error", repr(exc)
        return
    ep.reward += reward
    if terminated or truncated:
        ep.finish_reason = "terminated" if terminated else "truncated"
        return
    obs_ids = chat.observation_ids(obs)
    if len(ep.tokens) + len(obs_ids) + params.max_new_tokens > max_tokens:
        ep.finish_reason = "length"
        return
    ep.append(obs_ids, trained=False, version=version)


def evaluate(engine: Engine, chat, make_env: Callable[[], TextEnv], tasks: list[dict[str, Any]],
             max_new_tokens: int, max_tokens: int) -> dict[str, float]:
    """Greedy success rate (reward > 0) and mean reward over `tasks` (reset options)."""
    episodes = [start(make_env(), chat, options=opts, version=engine.version) for opts in tasks]
    play(engine, chat, episodes, SamplingParams(max_new_tokens, chat.stop_ids, temperature=0.0), max_tokens)
    rewards = np.array([e.reward for e in episodes])
    return {"success_rate": float((rewards > 0).mean()), "reward_mean": float(rewards.mean()),
            "turns_mean": float(np.mean([e.turns for e in episodes]))}
