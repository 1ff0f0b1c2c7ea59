"""Every built-in environment and a skyrl-gym one, run as the job runs them but in one process:
the job's config gives the environment's flags and the chat; a real actor (torch engine, the
untrained tiny policy, environments on its threads) plays groups into replay; a real world-1
learner (gloo) trains a step on them and publishes the adapter over its weight channel, which the
actor applies. The one process boundary here is the environment's own: every environment is also
built in a Ray worker from the config as the launcher ships it, and draws the driver's task. The
whole job with subprocesses and Ray: tests/launch/test_smoke.py."""

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


def test_the_image_maze_runs_with_a_vision_language_policy(tiny_vlm):
    """`--env image-maze` with a vision-language model: pictures from the environment through
    the actor's engine and replay to the learner, whose adapter (language model only) the actor
    applies."""
    cfg = config("image-maze", "--image-maze.max-steps", "4")
    assert cfg.model == "builtin:vlm" and cfg.env_kwargs()["max_steps"] == 4
    stats, metrics = play_and_train(cfg, tiny_vlm)
    check(stats, metrics)


def test_a_text_model_is_refused_for_the_image_maze_before_anything_starts(tiny_model, tiny_vlm):
    """A text model cannot see pictures: the launcher stops at once with what to use instead,
    rather than playing the maze blind."""
    from launch.parts import check_sees_images

    with pytest.raises(ValueError, match="text model"):
        check_sees_images(config("image-maze", "--model", tiny_model), tiny_model)
    check_sees_images(config("image-maze", "--model", tiny_vlm), tiny_vlm)
    check_sees_images(config("maze", "--model", tiny_vlm), tiny_vlm)  # a VLM plays text tasks too


def test_skyrl_gym_environment_runs(tmp_path, tiny_model):
    pytest.importorskip("skyrl_gym")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? End with '#### <answer>'."}],
             "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": str(2 * i)}}
            for i in range(40)]
    tasks = tmp_path / "gsm8k.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in rows))
    stats, metrics = play_and_train(config("skyrl:gsm8k", "--skyrl.tasks", str(tasks)), tiny_model)
    check(stats, metrics)


@pytest.fixture(scope="module")
def ray_workers(tmp_path_factory):
    """A Ray of the job's own, started as the launcher starts one (`cluster.start_local` with its
    runtime environment), from a launch directory that holds a user's environment module."""
    import os

    import ray

    from launch import cluster

    here = tmp_path_factory.mktemp("launch-dir")
    (here / "my_maze_env.py").write_text("from envs.maze import MazeEnv\n\n\nclass Maze(MazeEnv):\n    pass\n")
    tasks = here / "gsm8k.jsonl"
    tasks.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                                           "env_class": "gsm8k",
                                           "reward_spec": {"method": "rule", "ground_truth": str(2 * i)}})
                               for i in range(8)))
    old = os.getcwd()
    os.chdir(here)
    try:
        cluster.start_local(2, cluster.runtime_env({}, "my_maze_env:Maze", joining=False))
    finally:
        os.chdir(old)
    yield tasks
    ray.shutdown()


def first_turn(cfg: Config, seed: int) -> tuple[list, float]:
    """The first observation of the task `seed` and the reward of a wrong answer to it, from the
    environment the config names, built as an actor builds it."""
    env = make_env(cfg.env, **cfg.env_kwargs())
    observation, _ = env.reset(seed=seed)
    _, reward, *_ = env.step("no idea")
    return list(observation), reward


@pytest.mark.parametrize("env", ["maze", "countdown", "sql", "calculator", "skyrl:gsm8k", "my_maze_env:Maze"])
def test_an_environment_is_built_in_a_ray_worker_from_the_config_the_launcher_ships(env, ray_workers):
    """What reaches an actor's process is the config (through Ray) and the environment's module
    (installed, or a user's from the launch directory): the worker draws the very task the driver
    draws from the same seed, so the evaluator and the actors agree on every task."""
    import ray

    import sys

    if env.startswith("skyrl"):
        pytest.importorskip("skyrl_gym")
    launch_dir = str(ray_workers.parent)  # a user's module is importable from there alone, as for a user
    sys.path.insert(0, launch_dir)
    try:
        cfg = config(env, *(["--skyrl.tasks", str(ray_workers)] if env.startswith("skyrl") else []))
        here = first_turn(cfg, 11)
    finally:
        sys.path.remove(launch_dir)
        sys.modules.pop("my_maze_env", None)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test module is not on the workers' path
    there = ray.get(ray.remote(first_turn).remote(cfg, 11), timeout=120)
    assert there == here and there[0] and there[1] == 0.0
