"""The learner group and the replay service of a run, from the driver: start them, watch them,
bring them back after a death (`LearnerGroup`, `ReplayService`; the actors: launch/fleet.py).

The ranks of a group fail together: a rank whose process dies leaves the others blocked in a
collective. So when any rank dies the driver kills every rank, makes a new group in the same
placement bundles and loads the newest checkpoint into it (`LearnerPart.setup(resume=True)`):
the steps since that checkpoint are lost, their data is not served again, and versions go on
above the highest published (learner/checkpoint.py). Rank 0 binds the weight channel's ports
of the first group, so the actors' subscriptions carry over. Past `--learner.restarts` deaths
the run stops with a message that gives the exact `--resume` command. A rank that raises (a
bad batch, a model that does not load) stops the run at once with its error (`LearnerFailed`): a
restart would raise again. It leaves its process group without the closing barrier
(`Learner.close(failed=True)`), so its error reaches the driver at once instead of after the
collective watchdog.

Usage::

    group = LearnerGroup(make, cfg.learners, restarts=2, resume=False)   # make(rank) -> Ray actor
    endpoints = group.start()       # the weight channel's endpoints
    while not group.done:
        for line in group.check():  # restarts a group with a dead rank; GroupFailed past the restarts
            print(line)
    group.result()                  # surfaces a rank's exception
"""

from __future__ import annotations

from typing import Any, Callable

from launch.fleet import RestartsSpent, first_line


class LearnerGroup:
    def __init__(self, make: Callable[[int], Any], n: int, restarts: int, resume: bool = False,
                 timeout: float = 900.0) -> None:
        self.make, self.n, self.max_restarts, self.timeout = make, n, restarts, timeout
        self.resume = resume
        self.restarts = 0
        """Times the group has been brought back so far."""
        self.ranks: list = []
        self.training: list = []
        self.endpoints: tuple[str, str] | None = None

    def start(self) -> tuple[str, str]:
        """Make the ranks, join them into one process group, load the model (and the newest
        checkpoint when resuming or restarting) and start training; the weight channel's endpoints."""
        import ray

        ports = tuple(int(e.rsplit(":", 1)[1]) for e in self.endpoints) if self.endpoints else (0, 0)
        self.ranks = [self.make(r) for r in range(self.n)]
        dist_url = ray.get(self.ranks[0].rendezvous.remote(), timeout=self.timeout)
        setups = [lr.setup.remote(dist_url, self.resume, ports) for lr in self.ranks]
        self.endpoints = ray.get(setups, timeout=self.timeout)[0]
        self.training = [lr.train.remote() for lr in self.ranks]
        return self.endpoints

    def check(self) -> list[str]:
        """Look at the ranks' `train` calls: a group with a dead rank is restarted from the newest
        checkpoint (the lines say so); GroupFailed past the restarts allowed. A rank's own error
        stops the run, unless a rank died: then the error is the survivors' collective failing."""
        import ray
        from ray.exceptions import RayActorError

        done, _ = ray.wait(self.training, num_returns=len(self.training), timeout=0)
        failed = {}
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as exc:
                return self._restart(exc)
            except Exception as exc:  # noqa: BLE001 - decided below, after asking who is alive
                failed[self.training.index(ref)] = exc
        if not failed:
            return []
        dead = self._dead()
        if dead is not None:
            return self._restart(dead)
        raise self._failure(failed)

    def _failure(self, failed: dict[int, BaseException], grace: float = 10.0) -> LearnerFailed:
        """The error that stops the run when ranks raised: the rank whose own code raised comes
        first, the ranks whose collective failed after it (gloo's peers fail at once; NCCL's wait
        in theirs, and the run's end stops them) after; every rank's error is in the message."""
        import ray

        ended, _ = ray.wait(self.training, num_returns=len(self.training), timeout=grace)
        for ref in ended:
            rank = self.training.index(ref)
            if rank not in failed:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - reported below
                    failed[rank] = exc
        ranks = sorted(failed, key=lambda r: (peer_failed(failed[r]), r))
        first = failed[ranks[0]]
        text = f"learner rank {ranks[0]} raised {describe(first)}"
        if len(ranks) > 1:
            text += "; then " + "; ".join(f"rank {r}: {describe(failed[r])}" for r in ranks[1:])
        return LearnerFailed(text + " (an error of the rank's own: the learner group is not restarted, a restart "
                             "would raise it again)", cause=first)

    def _dead(self, timeout: float = 10.0) -> BaseException | None:
        """The error of a rank whose process is gone, if any (each alive rank answers `where`)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        for lr in self.ranks:
            try:
                ray.get(lr.where.remote(), timeout=timeout)
            except RayActorError as exc:
                return exc
            except GetTimeoutError:
                continue
        return None

    @property
    def done(self) -> bool:
        """Whether every rank's `train` has returned (`result` then surfaces an exception)."""
        import ray

        ready, _ = ray.wait(self.training, num_returns=len(self.training), timeout=0)
        return len(ready) == len(self.training)

    def result(self) -> list[int]:
        import ray

        return ray.get(self.training)

    def _restart(self, exc: BaseException) -> list[str]:
        import ray

        why = first_line(exc)
        for lr in self.ranks:  # the living ranks are stuck in a collective with the dead one
            ray.kill(lr, no_restart=True)
        for ref in self.training:
            try:  # collected, so that Ray does not report them as unhandled errors
                ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - every one of them died with the group
                pass
        if self.restarts >= self.max_restarts:
            raise GroupFailed(f"a learner rank died after {self.restarts} restart(s) of the learner group, the most "
                              f"--learner.restarts {self.max_restarts} allows: {why}")
        self.restarts += 1
        self.resume = True
        self.start()
        return [f"a learner rank died ({why}); the learner group went back to its newest checkpoint "
                f"({self.restarts} of {self.max_restarts} restarts)"]

    def limit(self, steps: int) -> None:
        import ray

        ray.get([lr.limit.remote(steps) for lr in self.ranks])

    def actor_stats(self) -> list[dict]:
        """Colocated mode: each rank's generation counters, as an actor's (empty while a
        restarted group loads; a restarted rank counts from zero)."""
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get([r.actor_stats.remote() for r in self.ranks], timeout=30)
        except (RayActorError, ray.exceptions.GetTimeoutError):
            return []

    def drain_metrics(self) -> list[dict]:
        """Rank 0's metrics since the last call (empty while a restarted group loads)."""
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(self.ranks[0].drain_metrics.remote())
        except RayActorError:  # died: `finished` restarts the group
            return []


class GroupFailed(RestartsSpent):
    """The learner group died more often than --learner.restarts allows."""


class LearnerFailed(RuntimeError):
    """A learner rank raised: the run stops with that rank's error (`cause`, with its remote
    traceback) rather than restarting into the same error."""

    def __init__(self, text: str, cause: BaseException) -> None:
        super().__init__(text)
        self.cause = cause


_PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "remote worker", "NCCL", "Broken pipe",
                "DistBackendError", "DistNetworkError")


def peer_failed(exc: BaseException) -> bool:
    """Whether a rank's error looks like its collective failing because another rank left (a
    gloo socket closed, an NCCL error), rather than an error of its own code."""
    cause = getattr(exc, "cause", exc)  # a RayTaskError carries the rank's exception
    names = {c.__name__ for c in type(cause).__mro__}
    return bool(names & {"DistError", "DistBackendError", "DistNetworkError"}) or any(
        m in str(cause) for m in _PEER_FAILED)


def describe(exc: BaseException) -> str:
    """A rank's exception in one line: its type and the first line of its message."""
    cause = getattr(exc, "cause", exc)
    return f"{type(cause).__name__}: {first_line(cause)}"


class ReplayService:
    """The replay service of a run, from the driver: restarted on its port when its process dies.

    The parts keep talking to the same endpoint: their clients see the new server's epoch, say
    hello again, resend what was not acknowledged and ask again for what was parked (replay/client.py).
    With the run's log (on by default with checkpoints) every stored group, and every batch shard a
    learner holds, comes back; without it the stored groups are lost (the line says so). Past
    `--replay.restarts` deaths the run stops with a message.

    Usage::

        replay = ReplayService(lambda port: Replay.remote(cfg, key, port), restarts=3, logged=True)
        replay.endpoint                 # what actors and learners connect to
        for line in replay.check():     # a dead process is restarted; RuntimeError past the restarts
            print(line)
        replay.snapshot()               # the counters (None while restarting)
    """

    def __init__(self, make: Callable[[int], Any], restarts: int, logged: bool, timeout: float = 300.0) -> None:
        import ray

        self.make, self.max_restarts, self.logged, self.timeout = make, restarts, logged, timeout
        self.restarts = 0
        self.handle = make(0)
        self.endpoint = ray.get(self.handle.address.remote(), timeout=timeout)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.serving = self.handle.serve.remote()

    def check(self) -> list[str]:
        """Restart the service if its process died (the line says so); RuntimeError if it stopped
        on an error of its own (a log it cannot write) or died too often."""
        import ray
        from ray.exceptions import RayActorError

        ended, _ = ray.wait([self.serving], timeout=0)
        if not ended:
            return []
        try:
            ray.get(self.serving)
            raise RuntimeError("the replay service stopped before the run ended, without an error")
        except RayActorError as exc:
            return [self._restart(exc)]

    def _restart(self, exc: BaseException) -> str:
        import ray

        why = first_line(exc)
        if self.restarts >= self.max_restarts:
            raise RestartsSpent(f"the replay service died after {self.restarts} restart(s), the most "
                               f"--replay.restarts {self.max_restarts} allows: {why}")
        self.restarts += 1
        ray.kill(self.handle, no_restart=True)
        self.handle = self.make(self.port)
        ray.get(self.handle.address.remote(), timeout=self.timeout)
        self.serving = self.handle.serve.remote()
        kept = ("its log brings back every stored group" if self.logged
                else "without a log (--replay.no-log) the groups it stored are lost")
        return (f"the replay service died ({why}); restarted on port {self.port}, {kept} "
                f"({self.restarts} of {self.max_restarts})")

    def snapshot(self) -> dict | None:
        """The service's counters, or None while it is down (`check` restarts it)."""
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(self.handle.snapshot.remote(), timeout=self.timeout)
        except RayActorError:
            return None
