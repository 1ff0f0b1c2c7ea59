"""Short runs of the main job on every built-in environment and a skyrl-gym one, as a user would
start them (subprocesses, real Ray, real TensorBoard files; the untrained tiny policy)."""

import json
import subprocess
import sys

import pytest

from launch.plot import read_scalars

pytestmark = pytest.mark.slow

SMALL = ("--actors", "2", "--learners", "1", "--steps", "2", "--eval-episodes", "4",
         "--learner.groups-per-step", "2", "--actor.group-size", "4")


def launch(logdir, *args):
    run = subprocess.run([sys.executable, "-m", "launch.async", *SMALL, "--logdir", str(logdir), *args],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 2 steps" in run.stdout
    scalars = read_scalars(str(logdir))
    for tag in ("eval/success_rate", "rollout/reward_mean", "learner/loss", "rollout/env_errors"):
        assert tag in scalars, tag
    return scalars


@pytest.mark.parametrize("env", ["countdown", "sql", "calculator"])
def test_built_in_environment_runs(env, tmp_path):
    scalars = launch(tmp_path / env, "--env", env)
    assert all(v == 0 for _, v in scalars["rollout/env_errors"])


def test_skyrl_gym_environment_runs(tmp_path):
    pytest.importorskip("skyrl_gym")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? End with '#### <answer>'."}],
             "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": str(2 * i)}}
            for i in range(40)]
    tasks = tmp_path / "gsm8k.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in rows))
    launch(tmp_path / "skyrl", "--env", "skyrl:gsm8k", "--skyrl.tasks", str(tasks))
