"""Tasks worth another group: the actor's side of prioritized level replay.

GRPO learns only from a group whose episodes did not all get the same reward. Late in a run most
fresh tasks are solved by every sample (or by none), and their groups teach nothing; a task whose
last group was mixed is likely to be mixed again while the policy is still learning it. So an
actor keeps the tasks (environment seeds) of its recent mixed groups, and starts a share of its
new groups (--actor.revisit) on one of them rather than on a fresh seed, picked with probability
proportional to the spread (standard deviation) of its last group's rewards: a task solved half
the time, the most informative for a group of 0/1 rewards, is picked most. A task leaves the pool
when it is picked (it comes back if its new group is mixed again) and, when the pool is full,
the oldest task makes room. This is prioritized level replay (Jiang, Grefenstette and
Rocktäschel, 2021) with the group's reward spread as the score: the tasks still come from the
environment's own distribution (a revisited seed is one it drew), only their order changes.

It needs an environment whose `reset(seed=...)` decides the task (every built-in one does).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class Revisits:
    """Usage::

        pool = Revisits(share=0.5, size=32, rng=np.random.default_rng(0))
        seed = pool.pick()                     # a task to revisit, or None: draw a fresh one
        pool.record(seed, [0.0, 1.0, 1.0])     # a finished group: kept when its rewards differ
    """

    def __init__(self, share: float, size: int, rng: np.random.Generator) -> None:
        if not 0 <= share < 1:
            raise ValueError(f"--actor.revisit is the share of new groups that revisit a task, in [0, 1), got {share}")
        if size < 1:
            raise ValueError(f"--actor.revisit-pool must be at least 1, got {size}")
        self.share, self.size, self.rng = share, size, rng
        self._pool: OrderedDict[int, float] = OrderedDict()  # seed -> its last group's reward std, oldest first

    def __len__(self) -> int:
        return len(self._pool)

    def pick(self) -> int | None:
        """A seed to start the next group on, taken out of the pool; None (a fresh task) with
        probability 1 - share, or when the pool is empty. Draws nothing from the generator when
        the share is 0, so an actor without revisits draws the same fresh seeds as before."""
        if not self._pool or self.share == 0 or self.rng.random() >= self.share:
            return None
        seeds = list(self._pool)
        weights = np.fromiter(self._pool.values(), dtype=np.float64)
        seed = seeds[int(self.rng.choice(len(seeds), p=weights / weights.sum()))]
        del self._pool[seed]
        return seed

    def record(self, seed: int, rewards: list[float]) -> bool:
        """Note a finished group of task `seed`: True when its rewards differ (it then joins the
        pool, unless the share is 0); a group whose rewards are all equal (or not numbers) has
        nothing to teach now and leaves it."""
        spread = float(np.std(rewards)) if len(rewards) > 1 else 0.0
        self._pool.pop(seed, None)
        if not spread > 0:
            return False
        if self.share > 0:
            self._pool[seed] = spread
            while len(self._pool) > self.size:
                self._pool.popitem(last=False)
        return True
