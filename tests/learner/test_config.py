"""Bad learner settings fail at once, naming the flag to change."""

import subprocess
import sys

import pytest

from launch.config import Config
from learner.config import LearnerConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"algo": "a2c"}, "unknown --algo 'a2c'; choose one of grpo, rloo, ppo"),
    ({"correction": "vtrace"}, "unknown --correction 'vtrace'; choose one of none, tis, seq-tis, geo-mask, decoupled"),
])
def test_bad_headline_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"mini_batches": 0}, "--learner.mini-batches"),
    ({"dual_clip": 0.5}, "--learner.dual-clip"),
    ({"behaviour_clip": 1.0}, "--learner.behaviour-clip"),
    ({"is_cap": 0.0}, "--correction none"),
    ({"drop_cap": 1.0}, "--learner.drop-cap"),
    ({"geo_bound": 1.0}, "--learner.geo-bound"),
    ({"norm_length": 0}, "--learner.norm-length"),
    ({"kl_coef": -1.0}, "--learner.kl-coef"),
    ({"lam": 1.5}, "--learner.lam"),
    ({"critic_lr": 0.0}, "--learner.critic-lr"),
    ({"step_weight": -1.0}, "--learner.step-weight must be ≥ 0"),
    ({"step_weight": float("nan")}, "--learner.step-weight"),
    ({"step_gamma": 0.0}, "--learner.step-gamma in \\(0, 1\\]"),
])
def test_bad_learner_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LearnerConfig(**kwargs)


def test_step_advantages_go_with_a_group_relative_estimator():
    assert Config(algo="rloo", learner=LearnerConfig(step_weight=1.0)).learner.step_weight == 1.0
    with pytest.raises(ValueError, match="PPO's critic gives each turn its own credit"):
        Config(algo="ppo", learner=LearnerConfig(step_weight=1.0))


def test_defaults_are_the_measured_recipe():
    cfg = Config()
    assert (cfg.algo, cfg.correction, cfg.learner.is_cap, cfg.learner.mini_batches) == ("grpo", "none", 2.0, 1)


def test_a_learner_built_directly_defaults_to_what_the_run_defaults_to():
    """Tests and benchmarks build `Learner` without the root config: they must train what the
    default run trains, so both take their defaults from learner/config.py."""
    import dataclasses
    import inspect

    from learner.config import DEFAULT_ALGO, DEFAULT_CORRECTION
    from learner.trainer import Learner

    learner = inspect.signature(Learner).parameters
    run = {f.name: f.default for f in dataclasses.fields(Config)}
    assert (learner["algo"].default, learner["correction"].default) == (run["algo"], run["correction"])
    assert (run["algo"], run["correction"]) == (DEFAULT_ALGO, DEFAULT_CORRECTION) == ("grpo", "none")


def test_command_line_rejects_an_unknown_algorithm():
    run = subprocess.run([sys.executable, "-m", "launch.async", "--algo", "a2c"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "--algo" in run.stdout + run.stderr


def test_learning_rate_schedules_by_hand():
    from learner.config import lr_factor

    # cosine over 5 steps to 0.1: p = step/4; 0.1 + 0.9·(1 + cos(πp))/2
    assert lr_factor("cosine", 0, 5, 0.1) == pytest.approx(1.0)
    assert lr_factor("cosine", 2, 5, 0.1) == pytest.approx(0.55)      # cos(π/2) = 0: 0.1 + 0.45
    assert lr_factor("cosine", 1, 5, 0.1) == pytest.approx(0.1 + 0.9 * (1 + 2 ** -0.5) / 2)  # 0.8682
    assert lr_factor("cosine", 4, 5, 0.1) == pytest.approx(0.1)
    assert lr_factor("cosine", 9, 5, 0.1) == pytest.approx(0.1)       # past the budget: stays at the end
    assert lr_factor("linear", 1, 5, 0.2) == pytest.approx(0.8)       # 1 − 0.8·0.25
    assert lr_factor("constant", 3, 5, 0.1) == 1.0
    assert lr_factor("cosine", 3, None, 0.1) == 1.0                   # no budget, no schedule


@pytest.mark.parametrize("kwargs, message", [
    ({"aggregation": "sum"}, "unknown --learner.aggregation 'sum'"),
    ({"kl_estimator": "k4"}, "unknown --learner.kl-estimator 'k4'; choose one of k1, k2, k3"),
    ({"lr_schedule": "step"}, "unknown --learner.lr-schedule 'step'; choose one of cosine, linear, constant"),
])
def test_bad_learner_choices_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):  # a section made in code checks its own choices
        LearnerConfig(**kwargs)


def test_a_learner_built_in_code_refuses_an_unknown_algorithm_before_it_loads_anything():
    from learner.trainer import Learner

    with pytest.raises(ValueError, match="unknown --algo 'a2c'; choose one of grpo, rloo, ppo"):
        Learner(LearnerConfig(), "/no/such/model", 0, 1, "tcp://127.0.0.1:1", None, algo="a2c")


def test_bad_schedule_names_the_flag():
    with pytest.raises(ValueError, match="--learner.lr-final"):
        LearnerConfig(lr_final=1.5)
