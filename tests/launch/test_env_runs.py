"""Every built-in environment and a skyrl-gym one, run as the job runs them but in one process:
the job's config gives the environment's flags and the chat; a real actor (torch engine, the
untrained tiny policy, environments on its threads) plays groups into replay; a real world-1
learner (gloo) trains a step on them and publishes the adapter over its weight channel, which the
actor applies. No signal or process boundary is under test here; the whole job with subprocesses
and Ray: tests/launch/test_smoke.py."""

import json
import math
import socket
import threading

import pytest

from actors.actor import Actor
from actors.engines import make_engine
from envs import make_env
from launch.config import Config
from learner.trainer import Learner
from replay.buffer import ReplayBuffer
from replay.client import LocalReplay
from weights.publisher import WeightPublisher
from weights.subscriber import WeightSubscriber

GROUPS, GROUP_SIZE = 2, 4


def free_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def play_and_train(cfg: Config, model: str) -> tuple[dict, dict]:
    """Two groups played with the learner's v0, one learner step on them, then more with
    v1: the actor's stats and the step's metrics."""
    buffer = ReplayBuffer(groups_per_step=GROUPS, max_staleness=cfg.max_staleness)
    publisher = WeightPublisher()
    learner = Learner(cfg.learner, model, 0, 1, free_url(), LocalReplay(buffer, actor="learner-0"),
                      temperature=cfg.actor.temperature, algo=cfg.algo, correction=cfg.correction, horizon=2,
                      publisher=publisher)
    subscriber = None
    try:
        learner.setup()
        subscriber = WeightSubscriber(publisher.endpoints)
        engine = make_engine(cfg.actor.engine, model, cfg.learner.lora, device="cpu", seed=0,
                             **cfg.actor.engine_options())
        kwargs = cfg.env_kwargs()
        actor = Actor(cfg.actor, "actor-0", engine, cfg.chat(model), lambda: make_env(cfg.env, **kwargs),
                      LocalReplay(buffer, actor="actor-0"), subscriber)
        actor.run(threading.Event(), max_groups=GROUPS)
        metrics = learner.step()
        actor.run(threading.Event(), max_groups=1)  # applies v1 first
        return actor.stats(), metrics
    finally:
        if subscriber is not None:
            subscriber.close()
        learner.close()
        publisher.close()


def config(env: str, *flags: str) -> Config:
    import tyro

    return tyro.cli(Config, args=["--env", env, "--learner.groups-per-step", str(GROUPS),
                                  "--actor.group-size", str(GROUP_SIZE), "--actor.groups-in-flight", str(GROUPS),
                                  *flags])


def check(stats: dict, metrics: dict) -> None:
    assert stats["groups"] > GROUPS and stats["trajectories"] == stats["groups"] * GROUP_SIZE
    assert stats["version"] == 1 and stats["adapters_applied"] >= 1  # the learner's step reached the actor
    assert stats.get("finish/env_error", 0) == 0, stats
    assert math.isfinite(metrics["loss"])


@pytest.mark.parametrize("env", ["countdown", "sql", "calculator"])
def test_built_in_environment_runs(env, tiny_model):
    stats, metrics = play_and_train(config(env), tiny_model)
    check(stats, metrics)


def test_skyrl_gym_environment_runs(tmp_path, tiny_model):
    pytest.importorskip("skyrl_gym")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? End with '#### <answer>'."}],
             "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": str(2 * i)}}
            for i in range(40)]
    tasks = tmp_path / "gsm8k.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in rows))
    stats, metrics = play_and_train(config("skyrl:gsm8k", "--skyrl.tasks", str(tasks)), tiny_model)
    check(stats, metrics)
