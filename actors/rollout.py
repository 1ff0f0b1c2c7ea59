"""Multi-turn rollouts: many episodes at once.

Every episode is played turn by turn: the engine samples the model's turn, the
environment steps on the decoded text, and the observation is rendered to
tokens and appended. Two drivers, chosen by the engine's kind (`driver`):
`turn` gives a batch engine (the torch engine) one generation for every ready
episode; `advance` hands a request engine (vLLM) each episode's turn the moment
its observation is ready and steps each environment the moment its completion
is back, so nothing waits for the rest of the batch. What the learner needs is
recorded as it happens: token ids, the behaviour log-prob of every sampled token,
the loss mask (1 on model tokens, 0 on prompt and observation tokens) and the
policy version that produced each model token, and the episode's images (in the
order of their tokens, which the chat expands: image tokens have mask 0), and each
model turn's state and reward (`anchor`: the environment's `info["state"]`, else the
observation the turn answered), for estimators that compare the turns played from the
same state. The learner trains on exactly these tokens and images; nothing is re-tokenised. A turn cut by `max_new_tokens` is closed
with the template's end-of-turn token (mask 0) before its observation.

`between_turns` is called before every turn: the actor uses it to apply a newer
adapter, so long episodes pick up new weights without restarting.

In tool-call mode (the environment declares `tools`) the chat renders the tools into the
prompt, and each model turn's calls are parsed in the template's format (`Chat.parse_tools`)
and handed to the environment as a `ToolTurn`; the tokens are the model's own as ever, and the
`tool` messages that answer the calls are appended as the template renders them.

An episode started with a `sampling_seed` asks the engine for each turn with a
request seed made from (sampling seed, turn number), so what it samples does not
depend on which other episodes share the batch that turn: an environment call
that makes an episode sit a turn out changes the batch by timing, and must not
change the other episodes' tokens. With the engine's seed and the same weights,
a run's episodes are then the same from run to run.

Environments are user code, so their resets and steps run on an `EnvRunner`:
concurrently, each with a time limit. An environment that raises, returns
something malformed or runs past its limit ends that episode with finish reason
`env_error`; the other episodes of the batch go on.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engine import Engine, RequestEngine, SamplingParams, stream_seed
from actors.envrunner import EnvRunner
from envs.base import STATE, TextEnv
from envs.tools import ToolCall, ToolTurn
from policy.chat import message_images
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
    version: int = 0
    """Policy version of the latest model turn (observations are stamped with it)."""
    images: list = field(default_factory=list)
    """The episode's images so far (uint8 H×W×3), in the order of their tokens."""
    sampling_seed: int | None = None
    """The episode's own random stream: turn k is requested with seed (sampling_seed, k). None:
    the engine's shared generator, so the episode's tokens depend on its batch companions."""
    busy: bool = False
    """True while the environment's reset or step for this episode is running, or (with a
    request engine) while its turn is being generated."""
    info: dict = field(default_factory=dict)
    """The `info` of the environment's last step (its numbers become TensorBoard scalars)."""
    discount: float = 1.0
    """γ of the return in `reward`: the environment's reward of turn t (from 0) counts γ^t, so
    of two episodes that reach the same reward the shorter has the larger return (1: the
    environment's rewards summed; evaluation always plays with 1)."""
    outcome: float = 0.0
    """The environment's rewards summed, undiscounted: what the episode achieved, whatever its
    length (equal to `reward` when `discount` is 1)."""
    novelty: float = 0.0
    """β of the exploration bonus a failed episode earns (`bonus`); 0: none."""
    greedy: bool = False
    """Played greedily: every token the policy's most probable, with its log-prob at the
    sampling temperature (`start`)."""
    state: int = 0
    """The anchor of the state the next turn is played from (`anchor`)."""
    anchors: list[int] = field(default_factory=list)
    """Each model turn's anchor: the state it was played from."""
    turn_rewards: list[float] = field(default_factory=list)
    """Each model turn's reward from the environment, undiscounted."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        self.logprobs, self.mask, self.versions = [0.0] * n, [0] * n, [0] * n

    def bonus(self) -> float:
        """β·(1 − 1/n) for an episode whose environment rewards sum to 0 or less, n the distinct
        states its turns were played from; 0 for one that earned a reward or that its environment
        broke (--actor.novelty)."""
        if not self.novelty or self.outcome > 0 or self.finish_reason == "env_error" or not self.anchors:
            return 0.0
        return self.novelty * (1.0 - 1.0 / len(set(self.anchors)))

    def request_seed(self) -> int | None:
        """The request seed of this episode's next turn (None: unseeded)."""
        return None if self.sampling_seed is None else stream_seed(self.sampling_seed, self.turns)

    def append(self, tokens: list[int], trained: bool, version: int | list[int],
               logprobs: list[float] | None = None):
        """Append `tokens`; `version` is one for all of them or one per token."""
        versions = version if isinstance(version, list) else [version] * len(tokens)
        assert len(versions) == len(tokens), "one version per token"
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.mask += [int(trained)] * len(tokens)
        self.versions += versions

    def trajectory(self) -> Trajectory:
        assert self.finish_reason is not None, "episode still running"
        # An episode its environment broke is recorded and counted, but not trained on: its
        # reward says nothing about the model's actions.
        mask = np.zeros(len(self.mask), np.uint8) if self.finish_reason == "env_error" else self.mask
        # A turn whose step broke has no reward: 0, and the turn is not trained on (above).
        turn_rewards = self.turn_rewards + [0.0] * (self.turns - len(self.turn_rewards))
        return Trajectory(tokens=np.asarray(self.tokens, np.int32), logprobs=np.asarray(self.logprobs, np.float32),
                          mask=np.asarray(mask, np.uint8), versions=np.asarray(self.versions, np.int32),
                          reward=self.reward + self.bonus(), turns=self.turns, finish_reason=self.finish_reason,
                          images=list(self.images), anchors=list(self.anchors), turn_rewards=turn_rewards)


def start(env: TextEnv, chat, runner: EnvRunner, seed: int | None = None,
          options: dict[str, Any] | None = None, version: int = 0,
          sampling_seed: int | None = None, discount: float = 1.0, greedy: bool = False,
          novelty: float = 0.0) -> Episode:
    """A new episode of `env`; its reset (with `seed` and `options`) runs on `runner` and `turn`
    picks up the prompt. `sampling_seed` names the episode's random stream, `discount` the γ of
    its return, `greedy` whether it is played greedily, `novelty` the β of its exploration bonus
    (`Episode`)."""
    ep = Episode(env=env, tokens=[], version=version, busy=True, sampling_seed=sampling_seed,
                 discount=discount, greedy=greedy, novelty=novelty)
    runner.submit(ep.session, _reset, env, seed, options)
    return ep


def _reset(env: TextEnv, seed, options):
    return env.reset(seed=seed, options=options)


def play(engine: Engine, chat, episodes: list[Episode], params: SamplingParams, max_tokens: int,
         runner: EnvRunner, between_turns: Callable[[], None] | None = None) -> list[Episode]:
    """Run every episode to its end; returns them (finished) in the same order."""
    step = driver(engine)
    while True:
        if between_turns is not None:
            between_turns()
        if not step(engine, chat, episodes, params, max_tokens, runner):
            return episodes


def driver(engine) -> Callable[..., int]:
    """`advance` for a request engine, `turn` for a batch engine: both take one step of every
    live episode that can move and return how many episodes are still running."""
    return advance if isinstance(engine, RequestEngine) else turn


def turn(engine: Engine, chat, episodes: list[Episode], params: SamplingParams, max_tokens: int,
         runner: EnvRunner) -> int:
    """One batched generation for every episode that is ready, then their environment steps
    (concurrently, on `runner`); returns how many episodes are still running.

    Episodes whose reset or step is still running sit this generation out."""
    by_session = {e.session: e for e in episodes}
    _apply(runner.collect(0.0), by_session, chat, params, max_tokens)
    ready = [e for e in episodes if e.finish_reason is None and not e.busy]
    if ready:
        # images only when some episode has any: a text engine needs no images argument
        extra = {"images": [e.images for e in ready]} if any(e.images for e in ready) else {}
        if any(e.greedy for e in ready):  # an engine that plays no greedy rows needs no flags
            extra["greedy"] = [e.greedy for e in ready]
        outs = engine.generate([e.tokens for e in ready], params, sessions=[e.session for e in ready],
                               seeds=[e.request_seed() for e in ready], **extra)
        for ep, out in zip(ready, outs):
            _generated(ep, out, engine.version, chat, runner)
        # Fast environments answer within the grace period and keep the batch together;
        # a slow one's episode rejoins a later generation.
        _apply(runner.collect(GRACE_S, need_all=True), by_session, chat, params, max_tokens)
    elif any(e.busy for e in episodes):
        _apply(runner.collect(IDLE_WAIT_S, need_all=False), by_session, chat, params, max_tokens)
    return sum(e.finish_reason is None for e in episodes)


def advance(engine: RequestEngine, chat, episodes: list[Episode], params: SamplingParams, max_tokens: int,
            runner: EnvRunner) -> int:
    """Submit the turn of every episode that is ready, take the completions that are back and
    start their environment steps; returns how many episodes are still running.

    Waits briefly (`POLL_S`) for a completion while requests are in flight, or for an
    environment call while only those are running."""
    by_session = {e.session: e for e in episodes}
    _apply(runner.collect(0.0), by_session, chat, params, max_tokens)
    for ep in episodes:
        if ep.finish_reason is None and not ep.busy:
            pictures = {"images": ep.images} if ep.images else {}
            engine.submit(ep.session, ep.tokens, params, seed=ep.request_seed(), **pictures)
            ep.busy = True
    if engine.pending:
        for session, out in engine.collect(timeout=POLL_S):
            ep = by_session.get(session)
            assert ep is not None, "a request engine serves one batch of episodes: pass every live episode"
            _generated(ep, out, engine.version, chat, runner)
    elif any(e.busy for e in episodes):
        _apply(runner.collect(IDLE_WAIT_S, need_all=False), by_session, chat, params, max_tokens)
    return sum(e.finish_reason is None for e in episodes)


def _generated(ep: Episode, out, version: int, chat, runner: EnvRunner) -> None:
    """Record a model turn (each token with the version that sampled it) and step the environment."""
    versions = out.versions if out.versions is not None else [version] * len(out.tokens)
    ep.append(out.tokens, trained=True, version=versions, logprobs=out.logprobs)
    ep.anchors.append(ep.state)
    ep.turns += 1
    ep.busy = True
    ep.version = versions[-1] if versions else version
    runner.submit(ep.session, _step, ep.env, chat, chat.decode(out.tokens))


def _step(env: TextEnv, chat, text: str):
    """The environment's step on a model turn: its text, or in tool-call mode its parsed calls."""
    if not env.tools:
        return env.step(text)
    rest, calls = chat.parse_tools(text)
    return env.step(ToolTurn(rest, tuple(ToolCall(c.name, c.arguments, c.error) for c in calls)))


POLL_S = 0.01
"""How long `advance` waits for a completion before looking at the environments again."""
GRACE_S = 0.05
"""How long a turn waits for its environment steps before generating without the slow ones."""
IDLE_WAIT_S = 0.2
"""How long a turn with nothing to generate waits for an environment step."""


def _apply(calls, by_session: dict, chat, params: SamplingParams, max_tokens: int) -> None:
    for call in calls:
        ep = by_session.get(call.key)
        assert ep is not None, "a runner serves one batch of episodes: pass every live episode to turn()"
        ep.busy = False
        if call.error is not None:
            _broken(ep, chat, call.error)
        elif call.fn is _reset:
            _opened(ep, chat, call.result, params, max_tokens)
        else:
            _stepped(ep, chat, call.result, params, max_tokens)


def _broken(ep: Episode, chat, error: BaseException) -> None:
    """End `ep` with finish reason env_error (a broken environment ends its episode, not the actor)."""
    ep.finish_reason, ep.error = "env_error", repr(error)
    if not ep.tokens:  # the reset failed: keep the trajectory well-formed
        ep.append([chat.stop_ids[0]], trained=False, version=ep.version)


def _opened(ep: Episode, chat, result, params: SamplingParams, max_tokens: int) -> None:
    try:
        messages, info = result
        declared = [t.schema() for t in ep.env.tools]
        if declared != chat.tools:
            raise ValueError(f"the environment declares the tools {_names(declared)} but the chat renders "
                             f"{_names(chat.tools)}: build the Chat with tools=[t.schema() for t in env.tools]")
        ids = chat.prompt_ids(messages)
        images = message_images(messages)
        ep.state = anchor(info, ids, images)
    except Exception as exc:  # a malformed return value is the environment's error
        _broken(ep, chat, exc)
        return
    ep.append(ids, trained=False, version=ep.version)
    ep.images += images
    if len(ids) + params.max_new_tokens > max_tokens:
        ep.finish_reason = "length"


def anchor(info: Any, ids: list[int], images: list) -> int:
    """A turn's state as a 63-bit key: the environment's `info["state"]` where it names one
    (a string: `TextEnv.reset` and `step` refuse anything else), else the observation as rendered
    (its token ids and its images' pixels)."""
    state = info.get(STATE) if isinstance(info, dict) else None
    digest = hashlib.blake2b(digest_size=8)
    if state is not None:
        digest.update(b"state\0" + state.encode())
    else:
        digest.update(np.asarray(ids, np.int64).tobytes())
        for image in images:
            digest.update(np.ascontiguousarray(image).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


def _names(tools: list[dict]) -> list:
    return [t.get("function", {}).get("name") for t in tools]


def _stepped(ep: Episode, chat, result, params: SamplingParams, max_tokens: int) -> None:
    try:
        obs, reward, terminated, truncated, info = result
        reward = float(reward)
        obs_ids = None if terminated or truncated else chat.observation_ids(obs)
        images = [] if obs_ids is None else message_images(obs)
        state = None if obs_ids is None else anchor(info, obs_ids, images)
    except Exception as exc:  # a malformed return value is the environment's error too
        _broken(ep, chat, exc)
        return
    ep.reward += reward * ep.discount ** (ep.turns - 1)  # the turn just played is turn turns - 1
    ep.outcome += reward
    ep.turn_rewards.append(reward)
    if state is not None:
        ep.state = state
    ep.info = info if isinstance(info, dict) else {}
    if terminated or truncated:
        ep.finish_reason = "terminated" if terminated else "truncated"
        return
    # A turn cut by max_new_tokens gets the end-of-turn token the model did not sample (mask 0),
    # so the observation follows the token the template puts before it.
    obs_ids = chat.closing(ep.tokens) + obs_ids
    if len(ep.tokens) + len(obs_ids) + params.max_new_tokens > max_tokens:
        ep.finish_reason = "length"
    else:
        ep.append(obs_ids, trained=False, version=ep.version)
        ep.images += images


def close(ep: Episode) -> None:
    """Close the episode's environment, unless it broke (closing it might hang as well)."""
    if ep.finish_reason == "env_error":
        return
    try:
        ep.env.close()
    except Exception as exc:
        ep.error = f"close failed: {exc!r}"


def abandon(episodes: list[Episode], runner: EnvRunner) -> None:
    """Close the environments of episodes that will not be finished (an actor stopping mid-group),
    so that nothing of them outlives the actor: a code task's work folder goes with its episode.
    Calls still running are waited for up to the runner's time limit first; an environment whose
    call ran past it is left alone (closing it might hang as well), and the sandbox's sweep at
    the next start removes what it holds."""
    late = {c.key for c in runner.collect(runner.timeout_s, need_all=True) if c.abandoned}
    for ep in episodes:
        if ep.session not in late:
            close(ep)


EVAL_WAVE = 64
"""Episodes `evaluate` gives a batch engine at once. A batch engine pads each generation to its
longest row, and an episode that joins a running batch widens that generation to its whole
prompt for every row; so evaluation plays waves of episodes that start together, and the next
wave starts when the last one has finished. A request engine (vLLM) schedules its own batches
and gets every episode at once."""


def evaluate(engine: Engine, chat, make_env: Callable[[], TextEnv], tasks: list[dict[str, Any]],
             max_new_tokens: int, max_tokens: int, runner: EnvRunner | None = None,
             temperature: float = 0.0, samples: int = 1, wave: int = EVAL_WAVE) -> dict[str, float]:
    """Success rate (reward > 0) and mean reward over `tasks` (reset options): greedy by default;
    with `temperature` > 0, each task is played `samples` times by the sampling policy and the
    rates are over all those episodes. Episode i samples with its own stream i, so an engine
    with the same seed and weights gives the same figures however the turns were batched, and
    whatever `wave` (episodes played at once by a batch engine, see EVAL_WAVE) is."""
    if samples < 1 or temperature < 0 or (samples > 1 and temperature == 0):
        raise ValueError(f"evaluate: samples ≥ 1 (more than one only when sampling) and temperature ≥ 0, "
                         f"got samples={samples}, temperature={temperature}")
    if wave < 1:
        raise ValueError(f"evaluate: wave must be at least 1, got {wave}")
    jobs = list(enumerate(o for o in tasks for _ in range(samples)))
    if isinstance(engine, RequestEngine):
        wave = max(1, len(jobs))
    own = runner is None
    runner = runner or EnvRunner()
    params = SamplingParams(max_new_tokens, chat.stop_ids, temperature=temperature)
    episodes: list[Episode] = []
    try:
        for first in range(0, len(jobs), wave):
            batch = [start(make_env(), chat, runner, options=opts, version=engine.version, sampling_seed=i)
                     for i, opts in jobs[first:first + wave]]
            episodes += batch
            play(engine, chat, batch, params, max_tokens, runner)
            for e in batch:
                close(e)
    finally:
        if own:
            runner.close()
    rewards = np.array([e.reward for e in episodes])
    return {"success_rate": float((rewards > 0).mean()), "reward_mean": float(rewards.mean()),
            "turns_mean": float(np.mean([e.turns for e in episodes])), "episodes": len(episodes)}
