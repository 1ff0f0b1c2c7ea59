"""PPO end to end, as a user runs it: the critic trains beside the policy, its scalars reach TensorBoard."""

import subprocess
import sys

import pytest

from launch.plot import read_scalars

pytestmark = pytest.mark.slow


def test_ppo_run_with_the_critic(tmp_path):
    # The command, on half the default batch: PPO trains on every trajectory (the critic
    # learns from uniform-reward groups too), so a step costs about twice a GRPO step.
    logdir = tmp_path / "ppo"
    run = subprocess.run([sys.executable, "-m", "launch.async", "--actors", "2", "--learners", "1", "--algo", "ppo",
                          "--steps", "3", "--learner.groups-per-step", "8", "--eval-episodes", "8",
                          "--logdir", str(logdir)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 3 steps" in run.stdout
    scalars = read_scalars(str(logdir))
    for tag in ("critic/value_loss", "critic/explained_variance", "critic/grad_norm", "learner/clip_fraction",
                "learner/is_weight_mean", "learner/mismatch_kl", "learner/entropy", "learner/masked_fraction"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3], tag
    # the critic is the learner's own: the saved adapter is the policy alone, which the actors load
    saved = (logdir / "adapter" / "adapter_model.safetensors").read_bytes()
    assert b"critic" not in saved and b"value_head" not in saved
