"""GPU placement: what each part asks Ray for, and which devices it then sees.

Ray is told of GPUs this machine does not have (`num_gpus` declared to Ray: the one thing faked
here, and it is outside the project); the parts are placed with the same option builders
launch/async.py uses (`replay_options`, `learner_options` in the `cluster.placement` group,
`actor_options`), and each reports Ray's GPU ids and its CUDA_VISIBLE_DEVICES after
`claim_devices`. torch here is a CPU build, so a part given a GPU cannot use it: the message it
stops with is checked too. The job itself against a cluster with declared GPUs:
tests/launch/test_gpu_job.py.
"""

import os

import pytest

from actors.actor import ActorConfig
from launch import cluster
from launch.config import Config
from launch.parts import (actor_options, claim_devices, gpu_demand, learner_gpus, learner_options,
                          replay_options)
from learner.config import LearnerConfig


@pytest.fixture(scope="module")
def ray_with_gpus():
    import ray

    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        yield ray
    finally:
        ray.shutdown()


class Probe:
    """Stands where a part stands: claims its devices first thing, reports what it sees."""

    def __init__(self, gpus: float, flag: str) -> None:
        self.error = None
        try:
            claim_devices(gpus, flag)
        except RuntimeError as exc:  # torch cannot use the GPU Ray gave (a CPU build here)
            self.error = str(exc)

    def seen(self) -> dict:
        import ray

        return {"ids": [str(i) for i in ray.get_gpu_ids()], "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "error": self.error}


def place(ray, cfg: Config) -> dict[str, dict]:
    """Every part of `cfg` placed as the job places it; what each sees."""
    group = cluster.placement(cfg.learners, learner_gpus(cfg), timeout=60)
    P = ray.remote(Probe)
    parts = {"replay": P.options(**replay_options(group)).remote(0, "")}
    parts.update({f"learner-{r}": P.options(**learner_options(cfg, group, r)).remote(learner_gpus(cfg),
                                                                                     "--learner.gpus")
                  for r in range(cfg.learners)})
    parts.update({f"actor-{i}": P.options(**actor_options(cfg)).remote(cfg.actor.num_gpus, "--actor.gpus")
                  for i in range(cfg.actors)})
    try:
        return dict(zip(parts, ray.get([p.seen.remote() for p in parts.values()], timeout=120)))
    finally:
        for p in parts.values():
            ray.kill(p)
        ray.util.remove_placement_group(group)


def test_learners_get_a_gpu_each_actors_share_one_and_cpu_parts_see_none(ray_with_gpus):
    import torch

    cfg = Config(actors=2, learners=2, actor=ActorConfig(gpus=0.5), learner=LearnerConfig(gpus=1))
    seen = place(ray_with_gpus, cfg)
    learners = [seen["learner-0"]["ids"], seen["learner-1"]["ids"]]
    actors = [seen["actor-0"]["ids"], seen["actor-1"]["ids"]]
    assert all(len(ids) == 1 for ids in learners + actors), seen
    assert learners[0] != learners[1], seen  # a device of its own for each rank
    assert actors[0] == actors[1] and actors[0] not in learners, seen  # 0.5 each: one GPU, shared
    for name in ("learner-0", "learner-1", "actor-0", "actor-1"):
        assert seen[name]["visible"] == seen[name]["ids"][0], seen  # it sees its GPU alone
    assert seen["replay"] == {"ids": [], "visible": "", "error": None}  # not every GPU of the node
    if torch.version.cuda is None:
        flag = {"learner-0": "--learner.gpus 1", "actor-0": "--actor.gpus 0.5"}
        for name, asked in flag.items():
            assert seen[name]["error"].startswith(f"this part asked for {asked} and Ray gave it GPU "
                                                  f"{seen[name]['ids'][0]} on "), seen[name]
            assert "but torch sees no CUDA device there (a CPU build of torch" in seen[name]["error"]


def test_the_default_run_asks_for_no_gpu_and_hides_the_node_s(ray_with_gpus):
    cfg = Config(actors=2, learners=2)
    assert gpu_demand(cfg) == [("actors", 2, 0.0), ("learner ranks", 2, 0.0)]
    seen = place(ray_with_gpus, cfg)
    assert all(s == {"ids": [], "visible": "", "error": None} for s in seen.values()), seen


def test_device_cuda_alone_still_means_a_gpu_per_part(ray_with_gpus):
    cfg = Config(actors=1, learners=2, actor=ActorConfig(device="cuda"), learner=LearnerConfig(device="cuda"))
    assert (cfg.actor.num_gpus, cfg.actor.engine_device, learner_gpus(cfg)) == (1.0, "cuda", 1.0)
    seen = place(ray_with_gpus, cfg)
    ids = [seen[n]["ids"] for n in ("actor-0", "learner-0", "learner-1")]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 3, seen


def test_a_part_built_outside_ray_keeps_the_devices_of_its_process(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    claim_devices(0, "")
    claim_devices(1, "--learner.gpus")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_the_gpus_asked_for_are_counted_against_the_cluster():
    cfg = Config(actors=3, learners=2, actor=ActorConfig(gpus=0.5), learner=LearnerConfig(gpus=1))
    demand = gpu_demand(cfg)  # the evaluation borrows an actor's engine: no share of its own
    assert demand == [("actors", 3, 0.5), ("learner ranks", 2, 1.0)]
    assert cluster.gpu_shortfall(demand, 3.5) is None
    short = cluster.gpu_shortfall(demand, 3)
    assert short.startswith("the parts ask for 3.5 GPUs (actors 3 × 0.5 + learner ranks 2 × 1)"
                            "; the Ray cluster has 3."), short
    assert cluster.gpu_shortfall(gpu_demand(Config()), 0) is None


def test_colocated_runs_count_no_actor_gpus():
    """--colocate runs no actor process: 1.5 GPUs (the evaluator's share and the rank's), not
    6 actors' shares on top (4.5)."""
    cfg = Config(colocate=True, learners=1, actor=ActorConfig(gpus=0.5), learner=LearnerConfig(gpus=1))
    demand = gpu_demand(cfg)
    assert demand == [("evaluator", 1, 0.5), ("learner ranks", 1, 1.0)]
    assert cluster.gpu_shortfall(demand, 1.5) is None and cluster.gpu_shortfall(demand, 2) is None
    assert cluster.gpu_shortfall(demand, 1).startswith("the parts ask for 1.5 GPUs")


def test_learner_bundles_carry_their_gpus():
    assert cluster.bundles(2, 0) == [{"CPU": 1}] * 3
    assert cluster.bundles(2, 0.5) == [{"CPU": 1}, {"CPU": 1, "GPU": 0.5}, {"CPU": 1, "GPU": 0.5}]


@pytest.mark.parametrize("make, message", [
    (lambda: ActorConfig(gpus=2), "--actor.gpus is the GPUs of one actor, in \\[0, 1\\]"),
    (lambda: ActorConfig(gpus=-1), "--actor.gpus is the GPUs of one actor"),
    (lambda: ActorConfig(gpus=1, device="cpu"), "--actor.gpus 1 with --actor.device cpu"),
    (lambda: ActorConfig(engine="vllm", gpus=0.5), "--actor.memory-fraction 0.85 with --actor.gpus 0.5: each vLLM"),
    (lambda: ActorConfig(engine="vllm", gpus=0.5, memory_fraction=0.5),
     "--actor.memory-fraction 0.5 with --actor.gpus 0.5: .* its CUDA context .* below 0.5, e.g. 0.47"),
    (lambda: LearnerConfig(gpus=2), "--learner.gpus is the GPUs of one rank, in \\[0, 1\\]"),
    (lambda: LearnerConfig(gpus=1, device="cpu"), "needs --learner.device auto or cuda; got 1 with cpu"),
    (lambda: Config(learners=2, learner=LearnerConfig(gpus=0.5)), "NCCL needs a GPU of its own for each rank"),
])
def test_bad_gpu_settings_name_the_flag(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_engine_runs_where_the_actor_has_its_device():
    assert (ActorConfig().num_gpus, ActorConfig().engine_device) == (0.0, "cpu")  # the default: unchanged
    assert (ActorConfig(gpus=0.25).num_gpus, ActorConfig(gpus=0.25).engine_device) == (0.25, "cuda")
    assert Config(learners=1, learner=LearnerConfig(gpus=0.5)).learner.gpus == 0.5  # one rank may share
    assert ActorConfig(engine="vllm", gpus=0.5, memory_fraction=0.4).num_gpus == 0.5


def test_the_evaluator_as_a_part_scores_what_the_driver_s_would(ray_with_gpus, tiny_model):
    """With --colocate and --actor.gpus the evaluator runs as an `EvalPart`; here on the CPU, the same
    greedy scores as the in-process one, before and after an adapter sent as safetensors bytes."""
    import torch
    from peft import get_peft_model_state_dict

    from launch.monitor import Evaluator
    from launch.evaluators import RemoteEvaluator, make_evaluator

    cfg = Config(actors=1, learners=1, env="countdown", eval_episodes=4, actor=ActorConfig(max_new_tokens=6))
    here = make_evaluator(cfg, tiny_model)
    assert isinstance(here, Evaluator)  # on the CPU it stays in the driver, as before
    there = RemoteEvaluator(cfg, tiny_model)
    try:
        assert there.evaluate() == here.evaluate() and there.version == 0
        gen = torch.Generator().manual_seed(0)
        tensors = {k: torch.randn(v.shape, generator=gen) * 0.5
                   for k, v in get_peft_model_state_dict(here.engine.model).items()}
        here.load(3, tensors)
        there.load(3, tensors)
        assert there.version == here.version == 3
        assert there.evaluate() == here.evaluate()
    finally:
        there.close()
        here.close()


class CannotStart:
    def __init__(self) -> None:
        claim_devices(1, "--actor.gpus")  # outside a GPU node's torch: it raises
        raise RuntimeError("this part cannot start here")

    def run(self) -> None:
        pass


def test_an_actor_whose_constructor_raises_stops_the_run_without_restarts(ray_with_gpus):
    import time

    from launch.fleet import Fleet, PartFailed

    fleet = Fleet(lambda i: ray_with_gpus.remote(CannotStart).options(num_cpus=1, num_gpus=1).remote(), 1, restarts=3)
    deadline = time.monotonic() + 120
    with pytest.raises(PartFailed, match=r"^actor-0 could not start: RuntimeError: this part "):
        while time.monotonic() < deadline:
            fleet.check()
            time.sleep(0.2)
    assert fleet.restarts == [0]  # a restart would raise again


@pytest.mark.slow  # an actor process with its engine (the loan itself: tests/actors/test_actor.py, fast)
def test_the_evaluation_borrows_an_actor_s_engine_and_scores_what_the_driver_s_would(ray_with_gpus, tiny_model):
    """Actors on GPUs lend their engines to the run's evaluation (launch/evaluators.py): a real
    actor part (here on the CPU, beside a replay service and a weight publisher in this process)
    scores what the driver's own evaluator scores, before and after an adapter sent with the call,
    and reports the version it evaluated; asking for a share of its own is left to --colocate."""
    import torch
    from peft import get_peft_model_state_dict

    from launch.evaluators import BorrowedEvaluator, make_evaluator
    from launch.fleet import Fleet
    from launch.monitor import Evaluator
    from launch.parts import ActorPart, ReplayPart
    from policy.adapter import Adapter
    from weights.publisher import WeightPublisher

    cfg = Config(actors=1, learners=1, env="countdown", eval_episodes=4, checkpoint_every=0,  # no replay log
                 actor=ActorConfig(max_new_tokens=6))
    gpus = Config(actors=1, learners=1, actor=ActorConfig(gpus=0.5))
    assert isinstance(make_evaluator(gpus, tiny_model, fleet=None), BorrowedEvaluator)
    here = Evaluator(cfg, tiny_model)
    replay, publisher, fleet = ReplayPart(cfg, key=None), WeightPublisher(), None
    try:
        tensors = {k: torch.zeros(v.shape) for k, v in get_peft_model_state_dict(here.engine.model).items()}
        publisher.publish(Adapter(0, "tiny", cfg.learner.lora.to_dict(), tensors))  # what a learner sends first
        fleet = Fleet(lambda i: ray_with_gpus.remote(ActorPart).options(**actor_options(cfg)).remote(
            cfg, tiny_model, i, replay.endpoint, publisher.endpoints, None), 1, restarts=0)
        borrowed = BorrowedEvaluator(fleet)
        assert borrowed.evaluate() == here.evaluate() and borrowed.version == 0
        gen = torch.Generator().manual_seed(0)
        tensors = {k: torch.randn(v.shape, generator=gen) * 0.5 for k, v in tensors.items()}
        here.load(3, tensors)
        borrowed.load(3, tensors)
        assert borrowed.evaluate() == here.evaluate() and borrowed.version == 3
        assert fleet.check() == []  # the actor plays on
    finally:
        if fleet is not None:
            fleet.stop(timeout=120)
            ray_with_gpus.kill(fleet.actors[0])
        publisher.close()
        replay.close()
        here.close()
