"""The learner's driving API without a process group (the training itself: test_fsdp.py)."""

import pytest

from learner.config import LearnerConfig
from learner.trainer import Learner


def _learner(**kwargs) -> Learner:
    learner = Learner(LearnerConfig(), "unused", 0, 1, "tcp://127.0.0.1:1", replay=None, **kwargs)

    def step():  # stands in for an optimizer step
        learner.steps_done += 1
        learner.version += 1
        return {}

    learner.step = step
    return learner


def test_the_schedule_spans_the_given_horizon_or_the_first_budget():
    assert _learner().horizon is None  # driven by `step` alone: a constant rate
    fixed = _learner(horizon=40)
    assert fixed.run(3) == 3 and fixed.horizon == 40
    budget = _learner()
    budget.limit(2)  # a time limit ends the run early; the schedule still spans the budget
    assert budget.run(5) == 2 and budget.horizon == 5


def test_the_horizon_is_set_once_not_patched():
    with pytest.raises(ValueError, match="horizon"):
        _learner(horizon=0)
    with pytest.raises(AttributeError):
        _learner().horizon = 3
