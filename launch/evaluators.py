"""Where the run's evaluation plays the policy, chosen by where the actors play it.

- Actors on the CPU: an `Evaluator` (launch/monitor.py) in the driver, with an engine of its own.
- Actors on GPUs: no engine and no GPU share of its own, which would idle between evaluations.
  `BorrowedEvaluator` plays the evaluation set on an actor's engine (`ActorPart.evaluate`,
  `Actor.lend`): actor-0 finishes its live groups, starts no new one, evaluates greedily, and
  plays on. What that costs is one actor's tail of a round and the evaluation itself, every
  --eval-every versions; the engine holds the newest adapter it has, so an evaluation scores
  that version (never older than the one asked for: the adapter travels with the call).
- --colocate with --actor.gpus above 0: no actor process to borrow from (the ranks' engines sleep
  between steps), so the evaluator is a part of its own with an actor's resources (`EvalPart`).
"""

from __future__ import annotations

from launch.config import Config
from launch.parts import actor_options, claim_devices, release_sandboxes, set_threads


class EvalPart:
    """The evaluator (launch/monitor.py) as a part, with an actor's resources: where the actors run
    the policy on GPUs, so does the evaluation, not on the driver's cuda:0. Adapters arrive as
    safetensors bytes."""

    def __init__(self, cfg: Config, model_path: str) -> None:
        from launch.monitor import Evaluator

        claim_devices(cfg.actor.num_gpus, "--actor.gpus")
        set_threads(cfg.actor.threads)
        self.evaluator = Evaluator(cfg, model_path)

    def load(self, version: int, blob: bytes) -> None:
        from safetensors.torch import load

        self.evaluator.load(version, load(blob))

    def version(self) -> int:
        return self.evaluator.version

    def evaluate(self) -> dict[str, float]:
        return self.evaluator.evaluate()

    def close(self) -> None:
        self.evaluator.close()
        release_sandboxes()


def _blob(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()})


class RemoteEvaluator:
    """The driver's handle on an `EvalPart`, with `Evaluator`'s methods."""

    def __init__(self, cfg: Config, model_path: str) -> None:
        import ray

        self.part = ray.remote(EvalPart).options(**actor_options(cfg)).remote(cfg, model_path)

    @property
    def version(self) -> int:
        import ray

        return ray.get(self.part.version.remote())

    def load(self, version: int, tensors: dict) -> None:
        import ray

        ray.get(self.part.load.remote(version, _blob(tensors)))

    def evaluate(self) -> dict[str, float]:
        import ray

        return ray.get(self.part.evaluate.remote())

    def close(self) -> None:
        import ray

        try:
            ray.get(self.part.close.remote(), timeout=60)
        except ray.exceptions.RayError:  # it failed already; the run reports why
            pass
        ray.kill(self.part)


class BorrowedEvaluator:
    """`Evaluator`'s methods over the actors' engines: each evaluation runs on actor-0, or on the
    next actor when that one has died (the fleet restarts it). `version` is the version last
    evaluated, which may be newer than the one loaded. An actor that could not start stops the
    run with its error, as the fleet's check would."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet
        self.version = 0
        self._adapter: tuple[int, bytes] | None = None

    def load(self, version: int, tensors: dict) -> None:
        self._adapter = (version, _blob(tensors))

    def evaluate(self) -> dict[str, float]:
        import ray
        from ray.exceptions import RayActorError

        from launch.fleet import first_line

        version, blob = self._adapter or (0, None)
        died = []
        for i, part in enumerate(self.fleet.actors):
            try:
                self.version, result = ray.get(part.evaluate.remote(version, blob))
                return result
            except RayActorError as exc:
                if exc.actor_init_failed:
                    raise
                died.append(f"actor-{i}: {first_line(exc)}")
        raise RuntimeError(f"no actor could lend its engine to the evaluation ({'; '.join(died)})")

    def close(self) -> None:
        """Nothing to release: the engines are the actors'."""


def make_evaluator(cfg: Config, model_path: str, fleet=None):
    """The run's evaluator (see the module's docstring): in this (the driver's) process on the CPU,
    on the actors of `fleet` when they have GPUs, as an `EvalPart` in colocated mode with GPUs."""
    if cfg.actor.num_gpus > 0 and not cfg.colocate:
        return BorrowedEvaluator(fleet)
    if cfg.actor.num_gpus > 0:
        return RemoteEvaluator(cfg, model_path)
    from launch.monitor import Evaluator

    return Evaluator(cfg, model_path)
