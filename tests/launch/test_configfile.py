"""`--config FILE` (launch/configfile.py): a YAML or JSON file in the shape of the flags, under the
command line's flags. Parsed exactly as `python -m launch.async` parses its command line
(`resumed_config`); the whole job from examples/maze.yaml runs in the slow tier."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.config import Config, resumed_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "maze.yaml")


def test_the_example_file_is_the_default_run():
    cfg = resumed_config(["--config", EXAMPLE])
    default = Config()
    assert dataclasses.replace(cfg, config=None, logdir=None) == dataclasses.replace(default, logdir=None)


def test_flags_override_the_file(tmp_path):
    file = tmp_path / "exp.yaml"
    file.write_text("steps: 7\nmax-staleness: 2\nlearner:\n  lr: 1e-4\n  lora: {rank: 8}\nmaze:\n  size: 5\n"
                    "chat_template_kwargs: {enable_thinking: false}\n")
    cfg = resumed_config(["--config", str(file), "--learner.lr", "3e-4", "--maze.min-path", "4"])
    assert (cfg.steps, cfg.max_staleness, cfg.learner.lr, cfg.learner.lora.rank) == (7, 2, 3e-4, 8)
    assert (cfg.maze.size, cfg.maze.min_path) == (5, 4)  # the file's and the flag's, side by side
    assert cfg.template_kwargs == {"enable_thinking": False} and cfg.config == str(file)
    assert resumed_config(["--config", str(file)]).learner.lr == 1e-4  # YAML's 1e-4 is a string: read as a float


def test_an_env_given_as_a_flag_picks_its_own_default_model(tmp_path):
    file = tmp_path / "exp.yaml"
    file.write_text("env: countdown\n")
    assert resumed_config(["--config", str(file)]).model == "builtin:tiny"
    assert resumed_config(["--config", str(file), "--env", "maze"]).model == "builtin:maze"


def _batch(cfg: Config) -> tuple:
    return cfg.actor.group_size, cfg.groups_per_step, cfg.replay.drop_zero_variance


def test_an_environment_s_own_defaults_yield_to_every_flag_given(tmp_path):
    # the image maze's defaults: groups of 16, 8 a step (128 sequences, as 16 groups of 8), the
    # equal-reward groups dropped; the text maze keeps the global ones
    assert _batch(resumed_config([])) == (8, 16, False)
    assert _batch(resumed_config(["--env", "image-maze"])) == (16, 8, True)
    # a flag given wins, also one equal to the global default, which a check of "left at the
    # default" could not tell from no flag at all
    assert _batch(resumed_config(["--env", "image-maze", "--actor.group-size", "8"])) == (8, 16, True)
    assert _batch(resumed_config(["--env", "image-maze", "--replay.no-drop-zero-variance"])) == (16, 8, False)
    assert _batch(resumed_config(["--env", "image-maze", "--learner.groups-per-step", "4"])) == (16, 4, True)
    # dynamic sampling only where it applies: PPO's critic and --colocate are not refused for it
    assert _batch(resumed_config(["--env", "image-maze", "--algo", "ppo"])) == (16, 8, False)
    assert _batch(resumed_config(["--env", "image-maze", "--colocate"])) == (16, 8, False)
    code = resumed_config(["--env", "code", "--actor.max-tokens", "4096"]).actor
    assert (code.max_new_tokens, code.max_tokens) == (256, 4096)
    # in a file: its keys win over the environment's defaults, the flags over both
    file = tmp_path / "exp.yaml"
    file.write_text("env: image-maze\nactor:\n  group-size: 8\n")
    assert _batch(resumed_config(["--config", str(file)])) == (8, 16, True)
    assert _batch(resumed_config(["--config", str(file), "--actor.group-size", "4"])) == (4, 32, True)
    assert _batch(resumed_config(["--config", str(file), "--env", "maze"])) == (8, 16, False)


def _spread(cfg: Config) -> tuple:
    return cfg.actor.revisit, cfg.learner.entropy_coef


def test_the_image_maze_revisits_mixed_tasks_and_pays_an_entropy_bonus_unless_told_otherwise(tmp_path):
    assert _spread(resumed_config([])) == (0.0, 0.0)
    assert _spread(resumed_config(["--env", "image-maze"])) == (0.5, 0.01)
    assert _spread(resumed_config(["--env", "image-maze", "--actor.revisit", "0"])) == (0.0, 0.01)
    assert _spread(resumed_config(["--env", "image-maze", "--learner.entropy-coef", "0"])) == (0.5, 0.0)
    # neither depends on group-relative advantages or on the asynchronous mode
    assert _spread(resumed_config(["--env", "image-maze", "--algo", "ppo", "--colocate"])) == (0.5, 0.01)
    file = tmp_path / "exp.yaml"
    file.write_text("env: image-maze\nlearner:\n  entropy-coef: 0.02\n")
    assert _spread(resumed_config(["--config", str(file)])) == (0.5, 0.02)
    # the file's own key stays; what came from the image maze's defaults goes with --env maze
    assert _spread(resumed_config(["--config", str(file), "--env", "maze"])) == (0.0, 0.02)


def test_help_shows_the_defaults_of_the_env_it_is_given_with(capsys):
    for env, group in (("maze", 8), ("image-maze", 16)):
        with pytest.raises(SystemExit):
            resumed_config(["--env", env, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"Completions sampled per task (G, the GRPO group). (default: {group})" in text


def test_a_run_s_config_json_starts_a_new_run_with_its_settings(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    old = Config(steps=9, logdir=str(run), learner=Config().learner)
    old.maze.size = 3
    (run / "config.json").write_text(old.to_json())
    cfg = resumed_config(["--config", str(run / "config.json"), "--steps", "4"])
    assert (cfg.steps, cfg.maze.size, cfg.resume) == (4, 3, None)
    assert cfg.logdir is None  # a directory of its own, not the old run's


@pytest.mark.parametrize("text, message", [
    ("stepz: 3\n", r"unknown key stepz \(did you mean steps\?\)"),
    ("learner:\n  lrr: 0.1\n", r"unknown key learner.lrr \(did you mean learner.lr\?\)"),
    ("learner: 0.1\n", r"learner is a section"),
    ("steps: many\n", r"steps must be an integer, got 'many'"),
    ("algo: dpo\n", r"algo must be one of grpo, rloo, ppo, got 'dpo'"),
    ("steps: 0\n", r"--steps must be at least 1"),
    ("- steps\n", r"must hold a mapping"),
    ("steps: [\n", r"not valid YAML"),
    ("resume: runs/x\n", r"run --resume DIR instead"),
])
def test_a_bad_file_fails_naming_the_key(tmp_path, text, message):
    file = tmp_path / "exp.yaml"
    file.write_text(text)
    with pytest.raises(ValueError, match=message):
        resumed_config(["--config", str(file)])


def test_a_missing_file_and_config_with_resume_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--config .*nothere.yaml: No such file"):
        resumed_config(["--config", str(tmp_path / "nothere.yaml")])
    with pytest.raises(ValueError, match="give one of them"):
        resumed_config(["--config", EXAMPLE, "--resume", str(tmp_path)])


def test_the_command_line_says_what_is_wrong_with_the_file(tmp_path):
    file = tmp_path / "exp.json"
    file.write_text(json.dumps({"learner": {"lrr": 0.1}}))
    run = subprocess.run([sys.executable, "-m", "launch.async", "--config", str(file)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "unknown key learner.lrr" in run.stderr, run.stderr


@pytest.mark.slow
def test_the_example_runs_with_an_override_on_top(tmp_path):
    run = subprocess.run([sys.executable, "-m", "launch.async", "--config", EXAMPLE, "--steps", "2",
                          "--actors", "2", "--learners", "1", "--eval-episodes", "4", "--learner.groups-per-step", "2",
                          "--learner.lr", "1e-4", "--logdir", str(tmp_path / "run")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 2 steps" in run.stdout
    written = json.loads((tmp_path / "run" / "config.json").read_text())
    assert written["learner"]["lr"] == 1e-4 and written["config"] == EXAMPLE and written["steps"] == 2
