"""Colocated generation on a real 2-rank FSDP2 group over gloo: each rank's torch engine runs on
the rank's own model (no second copy), generates without collectives (the ranks do different
amounts of work), samples what a plain model with the same adapter samples, and training goes on
afterwards."""

import numpy as np
import pytest

from replay.buffer import ReplayBuffer
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.server import ReplayServer
from tests.learner.test_model import _spawn
from tests.replay.helpers import make_group


def _rank(rank, url, model_path, endpoint, out):
    import torch

    from actors.engine import SamplingParams
    from actors.torch_engine import TorchEngine
    from learner.colocate import generating
    from learner.config import LearnerConfig
    from learner.trainer import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LearnerConfig(lr=1e-2, groups_per_step=4)
    learner = Learner(cfg, model_path, rank, 2, url, ZmqLearnerReplay(endpoint), temperature=0.7)
    try:
        learner.setup()
        learner.step()  # the policy adapter is no longer the identity
        tensors = learner.adapter_tensors()  # collective: before the ranks' work differs
        prompts = [make_group(seed=s).trajectories[0].tokens[:12 + s].tolist() for s in range(3 - rank)]
        params = SamplingParams(6, (), 0.7)
        seeds = list(range(len(prompts)))
        engine = TorchEngine(model_path, cfg.lora, seed=5, model=learner.model)
        shared = engine.model is learner.model and not engine._merged
        with generating(learner.model):
            ours = engine.generate(prompts, params, seeds=seeds)
            for _ in range(rank):  # rank 1 runs more forward passes than rank 0: none is a collective
                engine.generate(prompts, params, seeds=seeds)
        plain = TorchEngine(model_path, cfg.lora, seed=5, merge_lora=False)
        plain.load_adapter(1, tensors)
        theirs = plain.generate(prompts, params, seeds=seeds)
        bare = TorchEngine(model_path, cfg.lora, seed=5, merge_lora=False).generate(prompts, params, seeds=seeds)
        metrics = learner.step()  # sharded again: training goes on
        out.put((rank, dict(shared=shared, tokens=[c.tokens for c in ours], plain_tokens=[c.tokens for c in theirs],
                            gap=max(float(np.max(np.abs(np.array(a.logprobs) - np.array(b.logprobs))))
                                    for a, b in zip(ours, theirs)),
                            bare_gap=max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(ours, bare)),
                            loss=metrics["loss"], training=learner.model.training)))
    finally:
        learner.close()


def test_each_rank_generates_with_its_own_model_then_trains(tiny_model):
    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=1, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqActorReplay(endpoint, actor="actor-0")
        for i in range(8):
            client.push(make_group(seed=i, rewards=[1.0, 0.0, 0.0, 1.0]))
        results = _spawn(_rank, tiny_model, endpoint)
    finally:
        server.stop()
    for rank, r in results.items():
        assert r["shared"], rank  # the engine's model is the trainer's: one copy per rank
        assert r["tokens"] == r["plain_tokens"] and len(r["tokens"]) == 3 - rank
        assert r["gap"] < 1e-4, r["gap"]  # the same distribution as a plain model with the adapter
        assert r["bare_gap"] > 1e-3, r["bare_gap"]  # and the adapter mattered
        assert np.isfinite(r["loss"]) and r["training"]


def _flaky_maze(rank: int):
    """Environments of which one in four raises mid-episode (seeded by `rank`)."""
    import random

    from envs import make_env
    from tests.actors.test_isolation import Echo

    rng = random.Random(rank)
    return lambda: Echo("step-raise") if rng.random() < 0.25 else make_env("maze", max_steps=4)


def _loop_rank(rank, url, model_path, endpoint, env: str, steps: int, out):
    """A colocated rank: it plays its share of each step's groups on its own model, then trains."""
    import torch

    from actors.actor import ActorConfig
    from envs import make_env
    from launch.colocate import Colocated
    from learner.config import LearnerConfig
    from learner.trainer import Learner
    from policy.load import load_chat

    torch.set_num_threads(1)
    torch.manual_seed(0)
    learner = Learner(LearnerConfig(lr=1e-3, groups_per_step=4), model_path, rank, 2, url,
                      ZmqLearnerReplay(endpoint), temperature=0.7)
    envs = _flaky_maze(rank) if env == "flaky-maze" else (lambda: make_env(env, max_steps=4))
    try:
        learner.setup()
        colocated = Colocated(learner, ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=4),
                              load_chat(model_path), envs, ZmqActorReplay(endpoint, actor=f"learner-{rank}"),
                              share=2, seed=rank)
        learner.before_step = colocated.generate
        learner.run(steps)
        out.put((rank, dict(metrics=learner.drain_metrics(), stats=colocated.stats(), version=learner.version)))
    finally:
        learner.close()


def test_a_colocated_rank_plays_its_share_then_trains_on_it_strictly_on_policy(tiny_model):
    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=0, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        results = _spawn(_loop_rank, tiny_model, endpoint, "flaky-maze", 3)
        stats = server.buffer.snapshot()
    finally:
        server.stop()
    for rank, r in results.items():
        assert r["version"] == 3 and [m["step"] for m in r["metrics"]] == [1, 2, 3]
        for m in r["metrics"]:
            assert m["staleness_max"] == 0.0  # every group was played by the weights it trains
            assert m["generate_s"] > 0 and np.isfinite(m["loss"])
        assert r["stats"]["groups"] == 3 * 2  # its share of each step: 2 of the 4 groups
    # every group played was trained on: none stale, none left over
    assert stats["received_groups"] == 12 and not sum(stats["dropped"].values()) and stats["queue_groups"] == 0
    errors = sum(r["stats"].get("finish/env_error", 0) for r in results.values())
    assert errors > 0  # environments failed, and the run went on


def test_a_colocated_vision_language_rank_plays_the_image_maze_on_its_own_model(tiny_vlm):
    """`--colocate --env image-maze`: each rank's engine is its own sharded VLM (gathered to
    generate), the pictures go through replay with the groups, and every step is on policy."""
    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=0, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        results = _spawn(_loop_rank, tiny_vlm, endpoint, "image-maze", 2)
        stats = server.buffer.snapshot()
    finally:
        server.stop()
    for r in results.values():
        assert r["version"] == 2 and [m["step"] for m in r["metrics"]] == [1, 2]
        assert all(m["staleness_max"] == 0.0 and np.isfinite(m["loss"]) for m in r["metrics"])
        assert r["stats"].get("finish/env_error", 0) == 0, r["stats"]
    assert stats["received_groups"] == 8 and stats["queue_groups"] == 0


@pytest.mark.gpu
def test_on_a_gpu_a_colocated_vllm_engine_stays_awake_once_the_first_step_shows_it_fits(tiny_model):
    """--actor.sleep auto (launch/colocate.py): the engine sleeps (level 1) around the first step,
    which measures the learner's peak; the tiny model's engine at 0.3 of the GPU fits beside it, so
    from the second step on it keeps its weights and KV cache on the GPU and sleeps no more."""
    pytest.importorskip("vllm")
    from actors.actor import ActorConfig
    from envs import make_env
    from launch.colocate import Colocated
    from learner.config import LearnerConfig
    from learner.trainer import Learner
    from policy.load import load_chat
    from tests.learner.test_fsdp import _port

    server = ReplayServer(ReplayBuffer(groups_per_step=2, max_staleness=0), "tcp://127.0.0.1:*")
    endpoint = server.start()
    learner = Learner(LearnerConfig(lr=1e-2, groups_per_step=2, device="cuda"), tiny_model, 0, 1,
                      f"tcp://127.0.0.1:{_port()}", ZmqLearnerReplay(endpoint), temperature=0.7)
    colocated = None
    try:
        learner.setup()
        cfg = ActorConfig(engine="vllm", group_size=2, groups_in_flight=2, max_new_tokens=4, memory_fraction=0.3,
                          enforce_eager=True)
        colocated = Colocated(learner, cfg, load_chat(tiny_model), lambda: make_env("maze", max_steps=3),
                              ZmqActorReplay(endpoint, actor="learner-0"), share=2)
        learner.before_step = colocated.generate
        learner.run(3)
        engine = colocated.actor.engine
        sleeps, asleep = engine.stats["sleeps"], engine.asleep
    finally:
        if colocated is not None:
            colocated.close()
        learner.close()
        server.stop()
    assert colocated.sleep == "keep" and colocated.released > 0
    assert sleeps == 2 and not asleep  # the wake check's sleep and the first step's; none after
