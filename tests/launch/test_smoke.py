"""The main job, run as a new user would: subprocesses, real Ray, real TensorBoard files.

These build the maze warm start on first use (cached afterwards), as the
default run does.
"""

import json
import subprocess
import sys

import pytest

from launch.config import Config
from launch.plot import read_scalars

pytestmark = pytest.mark.slow

REQUIRED = ("eval/success_rate", "rollout/reward_mean", "async/staleness_mean", "learner/loss",
            "perf/trajectories_per_s", "perf/learner_idle_fraction")


def launch(*args, timeout=900):
    run = subprocess.run([sys.executable, "-m", "launch.async", *args], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_async_ppo_run_with_six_actors_and_two_learners(tmp_path):
    """The quick start's six actors and two learners, with PPO (GRPO, the default, is every other
    job's): the critic trains beside the policy on half the default batch, since PPO trains on
    every trajectory (the critic learns from uniform-reward groups too). Then the saved adapter is
    evaluated with launch.eval, greedy and sampled."""
    logdir = tmp_path / "async"
    run = launch("--actors", "6", "--learners", "2", "--algo", "ppo", "--steps", "3", "--learner.groups-per-step", "8",
                 "--logdir", str(logdir))
    assert "done: 3 steps" in run.stdout
    scalars = read_scalars(str(logdir))
    for tag in REQUIRED:
        assert tag in scalars, f"{tag} missing from TensorBoard events"
    assert scalars["eval/success_rate"][0][0] == 0  # logged at version 0, before any update
    for tag in ("learner/loss", "critic/value_loss", "critic/explained_variance", "critic/grad_norm",
                "learner/clip_fraction", "learner/is_weight_mean", "learner/mismatch_kl", "learner/entropy",
                "learner/masked_fraction"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3], tag
    # the critic is the learner's own: the saved adapter is the policy alone, which the actors load
    saved_adapter = (logdir / "adapter" / "adapter_model.safetensors").read_bytes()
    assert b"critic" not in saved_adapter and b"value_head" not in saved_adapter
    saved = Config.from_json((logdir / "config.json").read_text())  # how the run was started
    assert (saved.actors, saved.learners, saved.algo, saved.steps, saved.logdir) == (6, 2, "ppo", 3, str(logdir))
    ev = subprocess.run([sys.executable, "-m", "launch.eval", str(logdir / "adapter"), "--episodes", "8",
                         "--seed", "7"], capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert 0.0 <= json.loads(ev.stdout.strip().splitlines()[-1])["success_rate"] <= 1.0
    sampled = subprocess.run([sys.executable, "-m", "launch.eval", str(logdir / "adapter"), "--episodes", "4",
                              "--temperature", "1.0", "--samples", "2"], capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert json.loads(sampled.stdout.strip().splitlines()[-1])["episodes"] == 8  # 4 tasks, 2 plays each
    greedy_twice = subprocess.run([sys.executable, "-m", "launch.eval", str(logdir / "adapter"), "--samples", "2"],
                                  capture_output=True, text=True, timeout=300)
    assert greedy_twice.returncode != 0 and "error: evaluate: samples" in greedy_twice.stderr


def test_async_run_with_vllm_actors(tmp_path):
    """`--actor.engine vllm` end to end: vLLM's CPU build here, as `.[test]` installs it. One vLLM
    actor (and the evaluator's engine, a second one in the driver): each engine takes two cores here
    for most of a minute to start; `--actors 2` for 20 steps is measured in docs/engines.md."""
    pytest.importorskip("vllm", reason="the vLLM engine needs vLLM: pip install -e '.[test]'")
    logdir = tmp_path / "vllm"
    run = launch("--actor.engine", "vllm", "--actors", "1", "--learners", "1", "--steps", "3",
                 "--learner.groups-per-step", "4", "--eval-episodes", "8", "--logdir", str(logdir))
    assert "done: 3 steps" in run.stdout
    scalars = read_scalars(str(logdir))
    for tag in REQUIRED:
        assert tag in scalars, f"{tag} missing from TensorBoard events"
    assert [s for s, _ in scalars["learner/loss"]] == [1, 2, 3]
    assert max(v for _, v in scalars["async/staleness_max"]) <= 1  # η = 1, versions recorded per token


def test_an_image_maze_run_trains_a_vision_language_policy_on_pictures(tmp_path):
    """`--env image-maze` with two actors and two FSDP learner ranks (the vision layers sharded
    too): pictures through replay to the learner, its adapter back to the actors (the image maze's
    own defaults: half the groups revisiting mixed tasks, an entropy bonus), evaluation on
    image-maze-64's first mazes, and launch.eval of the saved adapter, which adapts the language
    model only. The untrained tiny VLM keeps the job short (the warm start, builtin:vlm, is the
    default and is measured in docs/vision.md)."""
    logdir = tmp_path / "image-maze"
    run = launch("--env", "image-maze", "--model", "builtin:tiny-vlm", "--actors", "2", "--learners", "2",
                 "--steps", "3", "--eval-episodes", "8", "--logdir", str(logdir))
    assert "done: 3 steps" in run.stdout
    scalars = read_scalars(str(logdir))
    for tag in REQUIRED:
        assert tag in scalars, f"{tag} missing from TensorBoard events"
    assert [s for s, _ in scalars["learner/loss"]] == [1, 2, 3]
    # step 1 trains on groups of version 0 (staleness 0): the learner scores exactly what the engine saw
    assert scalars["async/staleness_max"][0] == (1, 0.0) and scalars["learner/mismatch_kl"][0][1] < 1e-6
    assert scalars.get("rollout/finished_env_error", [(0, 0.0)])[-1][1] == 0
    groups, mixed, revisited = (scalars[f"rollout/{k}"][-1][1] for k in ("groups", "groups_mixed", "groups_revisited"))
    assert groups > 0 and revisited <= groups and mixed <= groups  # the actors' counters reach TensorBoard
    saved_config = json.loads((logdir / "config.json").read_text())
    assert (saved_config["actor"]["revisit"], saved_config["learner"]["entropy_coef"]) == (0.5, 0.01)
    saved = (logdir / "adapter" / "adapter_config.json").read_text()
    assert "vision_model" in saved and b"vision_model" not in (logdir / "adapter" / "adapter_model.safetensors").read_bytes()
    ev = subprocess.run([sys.executable, "-m", "launch.eval", str(logdir / "adapter"), "--env", "image-maze",
                         "--episodes", "4"], capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads(ev.stdout.strip().splitlines()[-1])["episodes"] == 4


def test_colocated_run_is_strictly_on_policy(tmp_path):
    """Each learner rank generates its share of the batch with its own model, then trains."""
    logdir = tmp_path / "colocate"
    run = launch("--actors", "2", "--learners", "2", "--colocate", "--steps", "3", "--eval-episodes", "8",
                 "--logdir", str(logdir))
    assert "tandem: 0 actors, 2 learners, colocated" in run.stdout and "--actors is ignored" in run.stdout
    scalars = read_scalars(str(logdir))
    staleness = scalars["async/staleness_max"]
    assert [s for s, _ in staleness] == [1, 2, 3]
    assert all(v == 0.0 for _, v in staleness)
    for _, share in scalars["colocate/generate_share"]:
        assert 0 < share < 1
    assert all(v > 0 for _, v in scalars["colocate/generate_s"])
    assert scalars["rollout/finished_terminated"][-1][1] + scalars["rollout/finished_truncated"][-1][1] > 0


def test_ctrl_c_stops_every_process_and_leaves_readable_logs(tmp_path):
    import signal
    import time

    logdir = tmp_path / "interrupted"
    # A job started in the background by a non-interactive shell (as CI may start pytest) inherits
    # SIGINT ignored, and the job keeps it so; a user at a terminal has the default: so does this one.
    proc = subprocess.Popen([sys.executable, "-m", "launch.async", "--actors", "2", "--learners", "1",
                             "--steps", "100000", "--logdir", str(logdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    deadline = time.time() + 600
    for line in proc.stdout:
        seen.append(line)
        if "step " in line and "/100000" in line and not line.split("step ")[1].startswith("0/"):
            break  # training is under way
        assert time.time() < deadline, "".join(seen[-20:])
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen[-10:]) + rest[-3000:]
    assert "interrupted" in rest
    scalars = read_scalars(str(logdir))
    assert scalars["eval/success_rate"][0][0] == 0 and "learner/loss" in scalars
