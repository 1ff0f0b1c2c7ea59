"""A misbehaving environment ends its own episode with `env_error`; the batch and the actor go on.

Played as an actor plays: the real torch engine on the tiny policy, real environments next to
ones that raise, hang or are slow (stand-ins for users' environments)."""

import threading
import time

import numpy as np

from actors.actor import Actor, ActorConfig
from actors.engine import SamplingParams
from actors.torch_engine import TorchEngine
from actors.envrunner import EnvRunner
from actors.rollout import play, start
from envs import make_env
from envs.base import TextEnv
from policy.load import LoraSpec
from replay.buffer import ReplayBuffer
from replay.client import LocalReplay
from weights.publisher import WeightPublisher
from weights.subscriber import WeightSubscriber
from replay.wire import decode_group

LORA = LoraSpec(rank=4)
RELEASE = threading.Event()  # lets the hanging environments' threads end when the test is done


class Echo(TextEnv):
    """Ends after `turns` steps, each taking `delay_s`; `fail` says which call misbehaves."""

    def __init__(self, fail: str = "", delay_s: float = 0.0, turns: int = 3) -> None:
        super().__init__()
        self.fail, self.delay_s, self.turns, self.steps = fail, delay_s, turns, 0

    def _reset(self, options):
        if self.fail == "reset-hang":
            RELEASE.wait(120)
        if self.fail == "reset-raise":
            raise ConnectionError("tool server unreachable")
        return "say something", {}

    def _step(self, text):
        self.steps += 1
        if self.fail == "step-raise" and self.steps == 2:
            raise RuntimeError("sandbox crashed")
        if self.fail == "step-hang":
            RELEASE.wait(120)
        if self.fail == "step-garbage":
            return None
        time.sleep(self.delay_s)
        return f"turn {self.steps}", 0.5, self.steps >= self.turns, False, {}


def test_raising_and_hanging_environments_end_only_their_own_episodes(tiny_model, chat):
    engine = TorchEngine(tiny_model, LORA)
    runner = EnvRunner(timeout_s=1.0, threads=4)
    kinds = ["", "", "step-raise", "step-hang", "reset-raise", "reset-hang", "step-garbage", ""]
    episodes = [start(Echo(kind), chat, runner, seed=i) for i, kind in enumerate(kinds)]
    try:
        play(engine, chat, episodes, SamplingParams(4, chat.stop_ids), 512, runner)
    finally:
        RELEASE.set()
    by_kind = dict(zip(kinds, episodes))
    for kind, ep in zip(kinds, episodes):
        if kind:
            assert ep.finish_reason == "env_error", kind
        else:
            assert ep.finish_reason == "terminated" and ep.turns == 3 and ep.reward == 1.5
    assert "sandbox crashed" in by_kind["step-raise"].error and by_kind["step-raise"].turns == 2
    assert "TimeoutError" in by_kind["step-hang"].error and "TimeoutError" in by_kind["reset-hang"].error
    assert "tool server unreachable" in by_kind["reset-raise"].error
    assert "TypeError" in by_kind["step-garbage"].error
    assert runner.abandoned == 2
    for ep in episodes:  # every episode still makes a well-formed trajectory
        traj = ep.trajectory()
        assert len(traj.tokens) == len(traj.mask) == len(traj.logprobs) > 0
        if ep.finish_reason == "env_error":
            assert traj.mask.sum() == 0  # recorded, not trained on
    runner.close()


def test_a_slow_tool_does_not_stall_the_batch(tiny_model, chat):
    engine = TorchEngine(tiny_model, LORA)
    runner = EnvRunner(timeout_s=30.0, threads=4)
    slow = start(Echo(delay_s=1.0, turns=3), chat, runner, seed=0)
    fast = [start(Echo(turns=3), chat, runner, seed=i) for i in range(1, 5)]
    params = SamplingParams(4, chat.stop_ids)
    from actors.rollout import turn

    while any(e.finish_reason is None for e in fast):
        turn(engine, chat, [slow, *fast], params, 512, runner)
    assert slow.finish_reason is None and slow.turns < 3  # the fast episodes did not wait for it
    while turn(engine, chat, [slow, *fast], params, 512, runner):
        pass
    assert slow.finish_reason == "terminated" and slow.turns == 3
    runner.close()


def test_actor_keeps_pushing_groups_when_some_environments_break(tiny_model, chat):
    engine = TorchEngine(tiny_model, LORA)
    buffer = ReplayBuffer(groups_per_step=2, max_staleness=100)
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoints)
    rng = np.random.default_rng(0)

    def flaky_env():  # one environment in four raises mid-episode
        return Echo("step-raise") if rng.random() < 0.25 else make_env("maze", max_steps=4)

    cfg = ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=4, env_timeout_s=5.0)
    actor = Actor(cfg, "actor-0", engine, chat, flaky_env, LocalReplay(buffer, actor="actor-0"), subscriber)
    stop = threading.Event()
    from tests.actors.test_actor import random_adapter

    publisher.publish(random_adapter(engine, version=0, scale=0.0))
    thread = threading.Thread(target=actor.run, args=(stop, 6))
    thread.start()
    thread.join(180)
    stop.set()
    subscriber.close()
    publisher.close()
    groups = [decode_group(e.blob) for e in buffer.queue]
    reasons = [t.finish_reason for g in groups for t in g.trajectories]
    stats = actor.stats()
    assert len(groups) == 6 and stats["groups"] == 6
    assert "env_error" in reasons and stats["finish/env_error"] == reasons.count("env_error")
    assert {"terminated", "truncated"} & set(reasons)
