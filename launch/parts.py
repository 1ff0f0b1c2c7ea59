"""Each part as a plain object built from the root config, ready for Ray or one process.

Ray is only the placement layer: `launch/async.py` wraps these classes with
`ray.remote`; tests and debugging construct them directly. Each class owns its
threads and sockets and releases them in `close()`. `resolve_policy` gives the
model directory every part loads.
"""

from __future__ import annotations

import os
import threading

from launch import cluster
from launch.config import Config


def resolve_policy(cfg: Config) -> str:
    """The model `--model` names, as a path or id `from_pretrained` accepts; the maze warm start
    (`builtin:maze`) is built first if it is not cached yet."""
    if cfg.model == "builtin:maze":
        from launch.warmstart import ensure_warmstart

        return ensure_warmstart(log=lambda m: print(m, flush=True))
    from policy import resolve_model

    return resolve_model(cfg.model)


def _threads(n: int) -> None:
    import torch
    from transformers.utils import logging

    torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.disable_progress_bar()


class ReplayPart:
    """The replay service. `port` (a restart's: the port the parts already talk to) overrides
    --replay.port; with the run's log it comes back with every stored group."""

    def __init__(self, cfg: Config, key: bytes | None, port: int = 0) -> None:
        import dataclasses

        from replay.server import ReplayServer

        buffer = cfg.replay.make_buffer(cfg.learner.groups_per_step, cfg.staleness_bound, cfg.learners,
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
        _threads(cfg.learner.threads)
        self.cfg, self.model_path, self.rank, self.replay_endpoint, self.key = cfg, model_path, rank, replay_endpoint, key
        self.learner = None

    def rendezvous(self) -> str:
        """The learners' torch.distributed address: a free port on this (rank 0's) node."""
        return cluster.rendezvous(self.cfg.listen_host)

    def setup(self, dist_url: str, resume: bool = False, weight_ports: tuple[int, int] = (0, 0)):
        """Join the process group at `dist_url`, load the model (with `resume`, the run's newest
        checkpoint); rank 0 returns the weight channel's endpoints, on `weight_ports` when given
        (a restarted group: the actors are subscribed there)."""
        import torch

        from learner.checkpoint import Checkpoints
        from learner.trainer import Learner
        from replay.client import ZmqReplayClient

        cfg = self.cfg
        bind, advertise = cluster.listen(cfg.listen_host)
        cluster.point_collectives(advertise or bind)
        torch.manual_seed(cfg.seed)  # same adapter initialisation on every rank
        replay = ZmqReplayClient(self.replay_endpoint, key=self.key, arena_bytes=cfg.replay.arena_mb << 20,
                                 host=cluster.host_key())
        self.learner = Learner(cfg.learner, self.model_path, self.rank, cfg.learners, dist_url, replay,
                               temperature=cfg.actor.temperature, host=bind, advertise=advertise, key=self.key,
                               algo=cfg.algo, correction=cfg.correction, horizon=cfg.steps,
                               checkpoints=Checkpoints(cfg.run_dir, cfg.keep_checkpoints),
                               weight_ports=weight_ports)
        return self.learner.setup(resume=resume)

    def where(self) -> dict:
        return cluster.where()

    def train(self) -> int:
        """Run the step budget, save the final adapter under the run dir, shut down."""
        import pathlib

        save_dir = pathlib.Path(self.cfg.run_dir) / "adapter"
        try:
            version = self.learner.run(self.cfg.steps, save_dir=save_dir, checkpoint_every=self.cfg.checkpoint_every)
            self.learner.save_to(save_dir)
            return version
        finally:
            self.learner.close()

    def drain_metrics(self) -> list[dict]:
        return self.learner.drain_metrics()

    def limit(self, steps: int) -> None:
        self.learner.limit(steps)


class ActorPart:
    def __init__(self, cfg: Config, model_path: str, index: int, replay_endpoint: str,
                 weight_endpoints: tuple[str, str], key: bytes | None) -> None:
        from actors.actor import Actor
        from actors.engine import make_engine
        from envs import make_env
        from policy import Chat, load_tokenizer
        from replay.client import ZmqReplayClient
        from replay.weights import WeightSubscriber

        _threads(cfg.actor.threads)
        name = f"actor-{index}"
        replay = ZmqReplayClient(replay_endpoint, actor=name, key=key, arena_bytes=cfg.replay.arena_mb << 20,
                                 host=cluster.host_key())
        engine = make_engine(cfg.actor.engine, model_path, cfg.learner.lora, device=cfg.actor.device,
                             seed=cfg.seed * 1000 + index, **cfg.actor.engine_options())
        kwargs = cfg.env_kwargs()
        self.actor = Actor(cfg.actor, name, engine, Chat(load_tokenizer(model_path)),
                           lambda: make_env(cfg.env, **kwargs), replay,
                           WeightSubscriber(weight_endpoints, key=key), seed=cfg.seed * 1000 + index)
        self._stop = threading.Event()

    def run(self) -> None:
        try:
            self.actor.run(self._stop)
        finally:
            self.actor.engine.close()  # vLLM's engine processes end with the actor

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        return self.actor.stats()

    def where(self) -> dict:
        return cluster.where()
