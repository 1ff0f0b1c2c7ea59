"""The actors of a run, from the driver: their `run` calls, their counters, and restarts.

An actor whose process dies (killed, out of memory, its node lost) is replaced: the driver makes
a new Ray actor with the same arguments and calls `run` on it. The new process says hello to
replay, which gives back the credits the dead one held (`ReplayBuffer.hello`: groups it had
started are lost, never half-counted), and asks the weight publisher for the current adapter
before it generates. The driver does this itself rather than through Ray's `max_restarts`, so
that every death is seen and counted once, including one during the constructor (Ray would
restart that silently). Past `--actor.restarts` deaths of one actor the run stops with a
message. An actor that raises (an adapter it cannot apply, an environment module that does not
import, a GPU it asked for and cannot use) is not restarted: its error stops the run, since a
restart would raise it again (`PartFailed` for one whose constructor raised).

Counters survive a restart: an actor's counters start from zero in its new process, so the
driver adds what the dead process had reported last (what it did after its last report is not
counted).

Usage::

    fleet = Fleet(lambda i: Actor.remote(cfg, i, ...), cfg.actors, restarts=3)   # calls run() on each
    while training:
        for line in fleet.check():             # RuntimeError when an actor cannot go on
            print(line)
        scalars.update(actor_scalars(fleet.stats()))
    fleet.stop(timeout=120)
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable


class Fleet:
    def __init__(self, make: Callable[[int], Any], n: int, restarts: int) -> None:
        self.make, self.max_restarts = make, restarts
        self.actors = [make(i) for i in range(n)]
        """The current Ray actor handle of each actor."""
        self.runs = [a.run.remote() for a in self.actors]
        self.restarts = [0] * n
        """Restarts of each actor so far."""
        self._last: list[dict] = [{} for _ in range(n)]  # each actor's newest report, this process
        self._before: list[Counter] = [Counter() for _ in range(n)]  # what its dead processes reported

    def check(self) -> list[str]:
        """Look at the `run` calls that ended: restart the actors whose process died (the lines
        say so); RuntimeError for one that raised, ended on its own, or died too often."""
        import ray
        from ray.exceptions import RayActorError

        if not self.runs:  # colocated mode: no actor processes
            return []
        ended, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        lines = []
        for ref in ended:
            i = self.runs.index(ref)
            try:
                ray.get(ref)
            except RayActorError as exc:
                if exc.actor_init_failed:  # its constructor raised: a restart would raise again
                    raise PartFailed(f"actor-{i} could not start: {init_error(exc)}") from None
                if self.restarts[i] >= self.max_restarts:
                    raise RestartsSpent(f"actor-{i} died after {self.restarts[i]} restart(s), the most "
                                       f"--actor.restarts {self.max_restarts} allows: {first_line(exc)}") from None
                self.restarts[i] += 1
                self._before[i].update({k: v for k, v in self._last[i].items()
                                        if k != "version" and isinstance(v, (int, float))})
                self._last[i] = {}
                ray.kill(self.actors[i], no_restart=True)  # it is dead: let go of it for good
                self.actors[i] = self.make(i)
                self.runs[i] = self.actors[i].run.remote()
                lines.append(f"actor-{i} died ({first_line(exc)}); restarting it "
                             f"({self.restarts[i]} of {self.max_restarts})")
                continue
            # An error of the actor's own (RayTaskError carries it) stops the run with its message.
            raise RuntimeError(f"actor-{i} stopped before the run ended, without an error")
        return lines

    def stats(self, timeout: float = 5.0) -> list[dict]:
        """Each actor's counters, with those of its dead processes added; an actor that does not
        answer within `timeout` (it is restarting) counts as its last report."""
        import ray

        refs = [a.stats.remote() for a in self.actors]
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out = []
        for i, ref in enumerate(refs):
            if ref in ready:
                try:
                    self._last[i] = ray.get(ref)
                except ray.exceptions.RayError:  # died since: `check` restarts it
                    pass
            stats = dict(self._last[i])
            for k, v in self._before[i].items():
                stats[k] = stats.get(k, 0) + v
            out.append(stats)
        return out

    def stop(self, timeout: float) -> None:
        """Ask every actor to stop and wait for its `run` to return."""
        import ray

        for a in self.actors:
            a.stop.remote()
        ray.get(self.runs, timeout=timeout)


class RestartsSpent(RuntimeError):
    """A part died more often than its --*.restarts allows: the run stops, and the driver prints
    the `--resume` command that continues it from its newest checkpoint."""


class PartFailed(RuntimeError):
    """A part's constructor raised (a GPU it cannot use, a model it cannot load): the run stops."""


def init_error(exc: BaseException) -> str:
    """The error a part's constructor raised, from Ray's report of the actor's death: its last line
    ("RuntimeError: this part asked for ..."), without Ray's traceback."""
    lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
    return lines[-1][:1000] if lines else type(exc).__name__


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (a Ray error's is long), for a one-line report."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
