"""Both ends of the weight channel in one process: tests, debugging, a run without sockets.

`InProcessWeights` is a `Publisher` (weights/publisher.py) and each of its `subscriber()`s a
`WeightSource` (weights/subscriber.py): an adapter published is handed to every subscriber as it
is, with no copy, no chunks and no signatures (nothing crosses a process boundary).
"""

from __future__ import annotations

import threading

from policy.adapter import Adapter


class InProcessWeights:
    """A publisher whose subscribers live in the same process.

    Usage::

        weights = InProcessWeights()
        learner = Learner(cfg, ..., replay, publisher=weights)
        actor = Actor(cfg, ..., weights.subscriber())
    """

    def __init__(self) -> None:
        self.current: Adapter | None = None
        self.published = 0
        self._changed = threading.Condition()

    def publish(self, adapter: Adapter) -> int:
        """Keep `adapter` as the current one; its tensors' size in bytes. ValueError without tensors."""
        if not adapter.tensors:
            raise ValueError(f"adapter version {adapter.version} has no tensors: nothing to publish")
        with self._changed:
            self.current = adapter
            self.published += 1
            self._changed.notify_all()
        return sum(t.numel() * t.element_size() for t in adapter.tensors.values())

    def subscriber(self) -> InProcessSubscriber:
        """A new subscriber, which has no version yet."""
        return InProcessSubscriber(self)

    def close(self) -> None:
        """Nothing to release."""


class InProcessSubscriber:
    """One subscriber of an `InProcessWeights`: a `WeightSource`."""

    def __init__(self, weights: InProcessWeights) -> None:
        self._weights = weights
        self.version = -1
        """The newest version delivered."""

    def _newer(self) -> Adapter | None:
        adapter = self._weights.current
        if adapter is None or adapter.version <= self.version:
            return None
        self.version = adapter.version
        return adapter

    def poll(self) -> Adapter | None:
        """The current adapter if it is newer than the last one delivered, else None."""
        with self._weights._changed:
            return self._newer()

    def wait(self, timeout: float) -> Adapter | None:
        """Like `poll`, but block up to `timeout` seconds for a newer adapter."""
        with self._weights._changed:
            self._weights._changed.wait_for(lambda: (a := self._weights.current) is not None
                                            and a.version > self.version, timeout)
            return self._newer()

    def latest(self, timeout: float) -> Adapter | None:
        """The current adapter, if newer than the last one delivered (it is always at hand)."""
        return self.poll()

    def close(self) -> None:
        """Nothing to release."""
