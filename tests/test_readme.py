"""The README's "Write your own environment" example, run as a reader would: saved as guess.py,
checked with Gymnasium's checker, played, and trained on with the main job."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gymnasium.utils.env_checker import check_env

README = Path(__file__).resolve().parents[1] / "README.md"


def example_source() -> str:
    text = README.read_text()
    section = text.split("## Write your own environment", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture
def guess(tmp_path):
    path = tmp_path / "guess.py"
    path.write_text(example_source())
    spec = importlib.util.spec_from_file_location("guess", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_is_about_thirty_lines():
    assert len(example_source().strip().splitlines()) <= 40


def test_example_passes_the_checker_and_plays(guess):
    env = guess.GuessEnv()
    check_env(env, skip_render_check=True)
    env.reset(options={"secret": 420})
    assert env.step("")[0][0]["content"] == "Answer with a number."
    assert env.step("maybe 100?")[0][0]["content"] == "Higher."
    assert env.step("9" * 5000)[0][0]["content"] == "Lower."
    obs, reward, terminated, _, _ = env.step("420")
    assert (obs[0]["content"], reward, terminated) == ("Correct!", 1.0, True)
    held = {t["secret"] for t in env.eval_tasks(env.eval_seed, 64)}
    assert len(held) == 64 and not held & {env.reset(seed=s) and env.secret for s in range(500)}


@pytest.mark.slow
def test_example_trains_with_the_main_job(guess, tmp_path):
    run = subprocess.run([sys.executable, "-m", "launch.async", "--env", "guess:GuessEnv", "--steps", "2",
                          "--actors", "2", "--learners", "1", "--eval-episodes", "4",
                          "--learner.groups-per-step", "2", "--actor.group-size", "4",
                          "--logdir", str(tmp_path / "run")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 2 steps" in run.stdout
