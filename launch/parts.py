"""Each part as a plain object built from the root config, ready for Ray or one process.

Ray is only the placement layer: `launch/async.py` wraps these classes with
`ray.remote` and the options below (`*_options`: what each part asks Ray for);
tests and debugging construct them directly. Each class owns its threads and
sockets and releases them in `close()`. `resolve_policy` gives the model
directory every part loads.

Devices: an actor asks Ray for `--actor.gpus` GPUs, a learner rank for
`--learner.gpus` (in its placement bundle), replay for none. Each part sees only
its own: Ray sets CUDA_VISIBLE_DEVICES for a part with GPUs (its GPU is then
cuda:0, whatever its rank), and a part without is given an empty one
(`claim_devices`), since Ray 2.47+ leaves it unset and such a part would see
every GPU of its node and put its work on cuda:0, beside another part's. Where
the evaluator runs the policy: launch/evaluators.py.
"""

from __future__ import annotations

import os
import sys
import threading

from launch import cluster
from launch.config import Config


def resolve_policy(cfg: Config) -> str:
    """The directory of the model `--model` names, which every part loads (a Hub id's snapshot in
    the Hugging Face cache; policy.load.resolve_model); a warm start (`builtin:maze`,
    `builtin:vlm`) is built first if it is not cached yet. ModelNotFound (a ValueError) says what to do when there
    is none."""
    from launch.warmstart import WARM_STARTS, ensure_warmstart

    built = {name: env for env, (name, _) in WARM_STARTS.items()}
    if cfg.model in built:
        path = ensure_warmstart(log=lambda m: print(m, flush=True), env=built[cfg.model])
    else:
        from policy import resolve_model

        path = resolve_model(cfg.model)
    check_sees_images(cfg, path)
    return path


def check_sees_images(cfg: Config, model_path: str) -> None:
    """ValueError, before any part starts, when --env shows pictures and --model cannot see them."""
    import gymnasium as gym
    from gymnasium.envs.registration import load_env_creator
    from transformers import AutoConfig

    from envs import env_entry
    from policy.vision import is_vision

    env_cls = gym.registry[env_entry(cfg.env)].entry_point
    env_cls = load_env_creator(env_cls) if isinstance(env_cls, str) else env_cls
    if getattr(env_cls, "shows_images", False) and not is_vision(AutoConfig.from_pretrained(model_path)):
        raise ValueError(f"--env {cfg.env} shows pictures, but --model {cfg.model} is a text model: use a "
                         "vision-language model (builtin:vlm, or a Hugging Face one such as an Idefics3/SmolVLM)")


def learner_gpus(cfg: Config) -> float:
    """GPUs of one learner rank: --learner.gpus, or 1 with --learner.device cuda."""
    return cfg.learner.num_gpus


def replay_options(group) -> dict:
    """Ray options of the replay service: 1 CPU in bundle 0 of the placement group."""
    return {"num_cpus": 1, "num_gpus": 0, "max_concurrency": 2, **cluster.in_bundle(group, 0)}


def learner_options(cfg: Config, group, rank: int) -> dict:
    """Ray options of learner rank `rank`: its bundle of the group `cluster.placement` made
    with `learner_gpus(cfg)`, and those GPUs (a part gets GPUs only when it asks for them)."""
    return {"num_cpus": 1, "num_gpus": learner_gpus(cfg), "max_concurrency": 2, **cluster.in_bundle(group, 1 + rank)}


def actor_options(cfg: Config) -> dict:
    """Ray options of an actor, and of the evaluator when it runs as a part (launch/evaluators.py).
    Three threads: `run`, and the driver's `stats`, `stop` and `evaluate` beside it."""
    return {"num_cpus": 1, "num_gpus": cfg.actor.num_gpus, "max_concurrency": 3,
            "scheduling_strategy": "SPREAD" if cfg.actor.spread else "DEFAULT"}


def gpu_demand(cfg: Config) -> list[tuple[str, int, float]]:
    """(what, processes, GPUs each) the run asks Ray for, for `cluster.gpu_shortfall`. Actors on
    GPUs lend their engines to the evaluation, which asks for nothing then (launch/evaluators.py);
    with --colocate no actor process runs (each learner rank generates on its own devices), so
    the evaluator asks for --actor.gpus."""
    evaluator = [("evaluator", 1, cfg.actor.num_gpus)] if cfg.colocate and cfg.actor.num_gpus > 0 else []
    actors = [] if cfg.colocate else [("actors", cfg.actors, cfg.actor.num_gpus)]
    return [*actors, *evaluator, ("learner ranks", cfg.learners, learner_gpus(cfg))]


def claim_devices(gpus: float, flag: str) -> None:
    """In a Ray part, before anything touches CUDA: see only the devices Ray gave this part (none
    for `gpus` 0); RuntimeError, saying why, for a part that asked for GPUs it cannot use. Outside
    Ray (a part built in this process) the caller's devices are left as they are."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    if gpus <= 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return
    import torch

    ids = ", ".join(str(i) for i in ray.get_gpu_ids())
    if not ids or not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise RuntimeError(
            f"this part asked for {flag} {gpus:g} and Ray gave it GPU {ids or 'none'} on {cluster.node_address()}, "
            f"but torch sees no CUDA device there ({build}, torch {torch.__version__}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Install a CUDA build of torch on that node and check "
            f"its driver (nvidia-smi), or run the part on the CPU with {flag} 0")


def set_threads(n: int) -> None:
    import torch
    from transformers.utils import logging

    torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.disable_progress_bar()


def release_sandboxes() -> None:
    """The code environment's work folders end with the part's process, which Ray ends without its
    exit handlers. envs/sandbox.py is imported only where the environment was made."""
    sandbox = sys.modules.get("envs.sandbox")
    if sandbox is not None:
        sandbox.release()


class ReplayPart:
    """The replay service. `port` (a restart's: the port the parts already talk to) overrides
    --replay.port; with the run's log it comes back with every stored group."""

    def __init__(self, cfg: Config, key: bytes | None, port: int = 0) -> None:
        import dataclasses

        from replay.server import ReplayServer

        claim_devices(0, "")

        buffer = cfg.replay.make_buffer(cfg.groups_per_step, cfg.staleness_bound, cfg.learners,
                                        cfg.replay_log_dir)
        bind, advertise = cluster.listen(cfg.listen_host)
        replay = dataclasses.replace(cfg.replay, port=port) if port else cfg.replay
        self.server = ReplayServer(buffer, replay.bind(bind), key=key, advertise=advertise,
                                   host=cluster.host_key())
        self.endpoint = self.server.start()

    def address(self) -> str:
        return self.endpoint

    def serve(self) -> None:
        """Return when the service stops; raise the error it stopped on (a log it cannot write).
        The driver waits on this call to see the process die."""
        self.server.wait()

    def where(self) -> dict:
        return cluster.where()

    def snapshot(self) -> dict:
        return self.server.snapshot()

    def close(self) -> None:
        self.server.stop()


class LearnerPart:
    """One learner rank. Rank 0 makes the rendezvous address on its own node (`rendezvous`), then
    every rank joins it (`setup`)."""

    def __init__(self, cfg: Config, model_path: str, rank: int, replay_endpoint: str, key: bytes | None) -> None:
        claim_devices(learner_gpus(cfg), "--learner.gpus")
        if learner_gpus(cfg) > 0:
            os.environ["LOCAL_RANK"] = "0"  # the rank sees its own GPU alone, as cuda:0 (learner/trainer.py)
        set_threads(cfg.learner.threads)
        self.cfg, self.model_path, self.rank, self.replay_endpoint, self.key = cfg, model_path, rank, replay_endpoint, key
        self.learner = self.colocated = self.publisher = None

    def rendezvous(self) -> str:
        """The learners' torch.distributed address: a free port on this (rank 0's) node."""
        return cluster.rendezvous(self.cfg.listen_host)

    def setup(self, dist_url: str, resume: bool = False, weight_ports: tuple[int, int] = (0, 0)):
        """Join the process group at `dist_url`, load the model (with `resume`, the run's newest
        checkpoint); rank 0 builds the weight publisher and returns its endpoints, on
        `weight_ports` when given (a restarted group: the actors are subscribed there)."""
        import torch

        from learner.checkpoint import Checkpoints
        from learner.trainer import Learner
        from replay.zmq_client import ZmqLearnerReplay
        from weights.publisher import WeightPublisher

        cfg = self.cfg
        bind, advertise = cluster.listen(cfg.listen_host)
        cluster.point_collectives(advertise or bind)
        torch.manual_seed(cfg.seed)  # same adapter initialisation on every rank
        replay = ZmqLearnerReplay(self.replay_endpoint, key=self.key, arena_bytes=cfg.replay.arena_mb << 20,
                                  host=cluster.host_key())
        if self.rank == 0:
            self.publisher = WeightPublisher(bind, *weight_ports, key=self.key, advertise=advertise,
                                             host_key=cluster.host_key())
        self.learner = Learner(cfg.learner, self.model_path, self.rank, cfg.learners, dist_url, replay,
                               temperature=cfg.actor.temperature, algo=cfg.algo, correction=cfg.correction,
                               horizon=cfg.steps, checkpoints=Checkpoints(cfg.run_dir, cfg.keep_checkpoints),
                               publisher=self.publisher)
        self.learner.setup(resume=resume)
        if cfg.colocate:
            self._colocate()
        return self.publisher.endpoints if self.publisher is not None else None

    def _colocate(self) -> None:
        """Colocated mode: this rank plays its share of every step's groups before the step."""
        from envs import make_env
        from launch.colocate import Colocated
        from replay.zmq_client import ZmqActorReplay

        cfg = self.cfg
        replay = ZmqActorReplay(self.replay_endpoint, actor=f"learner-{self.rank}", key=self.key,
                                arena_bytes=cfg.replay.arena_mb << 20, host=cluster.host_key())
        kwargs = cfg.env_kwargs()
        self.colocated = Colocated(self.learner, cfg.rank_actor, cfg.chat(self.model_path),
                                   lambda: make_env(cfg.env, **kwargs), replay,
                                   share=cfg.groups_per_step // cfg.learners, seed=cfg.seed * 1000 + self.rank)
        self.learner.before_step = self.colocated.generate

    def actor_stats(self) -> dict:
        """Colocated mode: this rank's generation counters (as an actor's stats)."""
        return self.colocated.stats() if self.colocated is not None else {}

    def where(self) -> dict:
        return cluster.where()

    def train(self) -> int:
        """Run the step budget, save the final adapter under the run dir, shut down."""
        import pathlib

        save_dir = pathlib.Path(self.cfg.run_dir) / "adapter"
        failed = True
        try:
            version = self.learner.run(self.cfg.steps, save_dir=save_dir, checkpoint_every=self.cfg.checkpoint_every)
            self.learner.save_to(save_dir)
            failed = False
            return version
        finally:
            if self.colocated is not None:
                self.colocated.close()  # a colocated vLLM engine's processes end with the rank
            self.learner.close(failed)  # a failed rank skips the barrier: its error reaches the driver now
            if self.publisher is not None:
                self.publisher.close()
            release_sandboxes()

    def drain_metrics(self) -> list[dict]:
        return self.learner.drain_metrics()

    def limit(self, steps: int) -> None:
        self.learner.limit(steps)


class ActorPart:
    def __init__(self, cfg: Config, model_path: str, index: int, replay_endpoint: str,
                 weight_endpoints: tuple[str, str], key: bytes | None) -> None:
        from actors.actor import Actor
        from actors.engines import make_engine
        from envs import make_env
        from replay.zmq_client import ZmqActorReplay
        from weights.subscriber import WeightSubscriber

        claim_devices(cfg.actor.num_gpus, "--actor.gpus")
        set_threads(cfg.actor.threads)
        name = f"actor-{index}"
        replay = ZmqActorReplay(replay_endpoint, actor=name, key=key, arena_bytes=cfg.replay.arena_mb << 20,
                                host=cluster.host_key())
        engine = make_engine(cfg.actor.engine, model_path, cfg.learner.lora, device=cfg.actor.engine_device,
                             seed=cfg.seed * 1000 + index, **cfg.actor.engine_options())
        kwargs = cfg.env_kwargs()
        self.actor = Actor(cfg.actor, name, engine, cfg.chat(model_path),
                           lambda: make_env(cfg.env, **kwargs), replay,
                           WeightSubscriber(weight_endpoints, key=key, host_key=cluster.host_key()),
                           seed=cfg.seed * 1000 + index)
        self._stop = threading.Event()
        self.cfg, self.tasks = cfg, None

    def evaluate(self, version: int, blob: bytes | None) -> tuple[int, dict[str, float]]:
        """The run's evaluation on this actor's engine, between its groups (`Actor.lend`): greedy
        over the fixed evaluation set, with the adapter `version` (safetensors bytes) unless the
        engine holds a newer one. (The version evaluated, the scores.)"""
        from types import SimpleNamespace

        from actors.rollout import evaluate
        from launch.monitor import eval_tasks

        if self.tasks is None:
            self.tasks = eval_tasks(self.cfg)
        adapter = None
        if blob is not None:
            from safetensors.torch import load

            adapter = SimpleNamespace(version=version, tensors=load(blob))
        actor, cfg = self.actor, self.cfg.actor

        def play(engine):
            return engine.version, evaluate(engine, actor.chat, actor.make_env, self.tasks, cfg.max_new_tokens,
                                            cfg.max_tokens)

        return actor.lend(play, adapter)

    def run(self) -> None:
        try:
            self.actor.run(self._stop)
        finally:
            self.actor.engine.close()  # vLLM's engine processes end with the actor
            release_sandboxes()

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        return self.actor.stats()

    def where(self) -> dict:
        return cluster.where()
