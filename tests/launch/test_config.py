"""Bad configuration fails at once, with a message that says what to change."""

import os
import re
import subprocess
import sys

import pytest

from actors.actor import ActorConfig
from launch.config import Config, SkyrlConfig
from policy.choices import check_choices
from replay.server import ReplayConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"actors": 0}, "--actors must be at least 1"),
    ({"learners": 0}, "--learners must be at least 1"),
    ({"env": "chess"}, "--env: unknown environment 'chess'; choose one of maze, image-maze, countdown, sql"),
    ({"env": "skyrl:gsm8k"}, "--env skyrl:gsm8k needs --skyrl.tasks"),
    ({"env": "skyrl:gsm8k", "skyrl": SkyrlConfig(tasks="/no/such.jsonl")}, "--skyrl.tasks '/no/such.jsonl': no such file"),
    ({"env": "os:path"}, "is not a TextEnv subclass"),
    ({"env": "nosuchmodule:Env"}, "cannot import Env from nosuchmodule"),
    ({"steps": 0}, "--steps"),
    ({"max_staleness": -1}, "--max-staleness"),
    ({"learners": 3}, "multiple of --learners"),
    ({"actor": ActorConfig(engine="vllm", max_lora_rank=16)}, "--actor.max-lora-rank \\(16\\) is below"),
    ({"ray_address": "10.0.0.1:6379", "replay": ReplayConfig(sign=False)}, "frames between nodes are always signed"),
    ({"chat_template_kwargs": "{enable_thinking: false}"}, "--chat-template-kwargs must be a JSON object such as"),
    ({"chat_template_kwargs": "[1, 2]"}, "--chat-template-kwargs must be a JSON object \\(name: value\\)"),
])
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


def test_chat_template_kwargs_reach_the_template(tiny_model):
    cfg = Config(chat_template_kwargs='{"enable_thinking": false}')
    assert cfg.template_kwargs == {"enable_thinking": False}
    assert cfg.chat(tiny_model).template_kwargs == {"enable_thinking": False}
    assert Config().template_kwargs == {}


def test_tool_call_mode_gives_the_chat_the_environments_tools(tmp_path, tiny_model):
    from envs.calculator import CalculatorEnv
    from envs.sql import SqlEnv
    from launch.envconfig import CalculatorConfig, SqlConfig
    from policy.tiny import build_model
    from tests.policy.templates import build_tokenizer

    calculator = Config(env="calculator", calculator=CalculatorConfig(tool_calls=True))
    assert calculator.env_tools() == [CalculatorEnv.CALCULATE.schema()]
    assert Config(env="calculator").env_tools() == [] and Config().env_tools() == []
    with pytest.raises(ValueError, match="ignores tools .* run the environment without tool calls"):
        calculator.chat(tiny_model)  # the built-in policy's template declares no tools
    tok = build_tokenizer("qwen2.5")
    tok.save_pretrained(tmp_path)
    build_model(tok, hidden=32, layers=1).save_pretrained(tmp_path)
    chat = Config(env="sql", sql=SqlConfig(tool_calls=True)).chat(str(tmp_path))
    assert chat.tools == [SqlEnv.RUN_QUERY.schema()] and chat.tool_format == "hermes"
    assert Config(env="sql", tool_format="llama3-json").chat(str(tmp_path)).tools == []  # no tools: text mode


def test_parts_listen_on_loopback_unless_the_run_joins_a_cluster_or_is_told_otherwise():
    assert Config().listen_host == "127.0.0.1"
    assert Config(ray_address="10.0.0.1:6379").listen_host == "node"
    assert Config(ray_address="10.0.0.1:6379", replay=ReplayConfig(host="0.0.0.0")).listen_host == "0.0.0.0"
    assert Config(replay=ReplayConfig(host="192.168.1.5")).listen_host == "192.168.1.5"


def test_a_config_written_to_json_reads_back_the_same():
    from learner.config import LearnerConfig
    from policy.load import LoraSpec

    cfg = Config(actors=3, steps=7, env="countdown", ray_address="10.0.0.1:6379", logdir="runs/x",
                 actor=ActorConfig(engine="vllm", restarts=1, spread=False),
                 learner=LearnerConfig(lr=3e-5, lora=LoraSpec(rank=8, alpha=16.0, target_modules=["q_proj"])),
                 replay=ReplayConfig(host="0.0.0.0", capacity=99))
    again = Config.from_json(cfg.to_json())
    assert again == cfg and again.learner.lora.target_modules == ["q_proj"] and again.model == "builtin:tiny"
    with pytest.raises(ValueError, match="unknown field\\(s\\) warp"):
        Config.from_json('{"warp": 9}')
    with pytest.raises(ValueError, match="--actors must be at least 1"):  # checked as on the command line
        Config.from_json('{"actors": 0}')


def test_equal_reward_groups_are_dropped_for_group_relative_advantages_only():
    on = ReplayConfig(drop_zero_variance=True)
    assert Config(replay=on).replay.make_buffer(2, 1, 1).drop_zero_variance
    assert Config(replay=on, algo="rloo").replay.make_buffer(2, 1, 1).drop_zero_variance
    with pytest.raises(ValueError, match="PPO's critic learns from every group"):
        Config(replay=on, algo="ppo")
    with pytest.raises(ValueError, match="--colocate plays exactly each step's batch"):
        Config(replay=on, colocate=True)
    assert not Config().replay.make_buffer(2, 1, 1).drop_zero_variance  # off unless asked for
    assert ReplayConfig(drop_patience=3).make_buffer(2, 1, 1).drop_limit == 6
    with pytest.raises(ValueError, match="--replay.drop-patience must be at least 1"):
        ReplayConfig(drop_patience=0)


def test_colocate_is_strictly_on_policy():
    assert Config(colocate=True, max_staleness=8).staleness_bound == 0
    assert Config(max_staleness=8).staleness_bound == 8


@pytest.mark.parametrize("args, message", [
    (["--actors", "0"], "--actors must be at least 1"),
    (["--env", "chess"], "unknown environment 'chess'"),
    (["--maze.curriculum", "3@zero"], "--maze.curriculum: bad curriculum stage '3@zero'"),
    (["--actor.group-size", "1"], "--actor.group-size"),
    (["--actor.memory-fraction", "1.5"], "--actor.memory-fraction must be in (0, 1]"),
    (["--actor.in-flight", "drop"], "--actor.in-flight"),
])
def test_command_line_fails_fast(args, message):
    run = subprocess.run([sys.executable, "-m", "launch.async", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert message in run.stdout + run.stderr


def test_actors_on_gpus_the_cluster_lacks_fail_at_start(tmp_path):
    run = subprocess.run([sys.executable, "-m", "launch.async", "--actor.device", "cuda", "--actors", "2",
                          "--model", "builtin:tiny", "--logdir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "the parts ask for 2 GPUs (actors 2 × 1); the Ray cluster has 0" in run.stderr  # evaluated on an actor's


def choice_fields(section=None, prefix="--"):
    """(flag, choices) of every choice field (a `Literal` type) in the config tree."""
    import dataclasses
    import typing

    section = section or Config()
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        flag, value = prefix + f.name.replace("_", "-"), getattr(section, f.name)
        if typing.get_origin(hints[f.name]) is typing.Literal:
            yield flag, typing.get_args(hints[f.name])
        elif dataclasses.is_dataclass(value):
            yield from choice_fields(value, flag + ".")


def test_the_choice_fields_are_those_a_user_picks_from():
    flags = {flag for flag, _ in choice_fields()}
    assert {"--algo", "--correction", "--learner.aggregation", "--learner.kl-estimator", "--learner.lr-schedule",
            "--learner.dtype", "--learner.device", "--actor.engine", "--actor.in-flight", "--actor.device",
            "--actor.dtype", "--replay.order", "--replay.fsync", "--tool-format"} <= flags


def test_a_config_made_in_code_with_a_value_outside_a_choice_names_the_flag_and_the_choices():
    for flag, choices in choice_fields():
        path = flag[2:].replace("-", "_").split(".")
        cfg = Config()
        section = cfg
        for name in path[:-1]:
            section = getattr(section, name)
        object.__setattr__(section, path[-1], "bogus")
        with pytest.raises(ValueError, match=re.escape(f"unknown {flag} 'bogus'; choose one of {', '.join(choices)}")):
            check_choices(cfg)
        with pytest.raises(ValueError, match=re.escape(f"unknown {flag} 'bogus'")):  # as --resume reads it
            Config.from_json(cfg.to_json())


def test_help_lists_every_choice_and_the_command_line_refuses_others():
    # one column of help, wide enough that no list of choices wraps
    run = subprocess.run([sys.executable, "-m", "launch.async", "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "120"})
    assert run.returncode == 0
    for flag, choices in choice_fields():
        assert f"{flag} {{{','.join(choices)}}}" in run.stdout, flag
    for args, flag in ((["--learner.aggregation", "sum"], "--learner.aggregation"),
                       (["--actor.device", "tpu"], "--actor.device"), (["--replay.fsync", "sometimes"], "--replay.fsync")):
        run = subprocess.run([sys.executable, "-m", "launch.async", *args], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "COLUMNS": "400"})
        assert run.returncode != 0
        out = " ".join((run.stdout + run.stderr).split())
        assert f"invalid choice '{args[1]}' for argument '{flag}'" in out, out
        assert "python -m launch.async --help" in out


def test_help_lists_the_headline_flags():
    run = subprocess.run([sys.executable, "-m", "launch.async", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    for flag in ("--actors", "--learners", "--colocate", "--steps", "--logdir", "--max-staleness",
                 "--model", "--env", "--seed", "--ray-address", "--learner.lr", "--replay.capacity"):
        assert flag in run.stdout


def test_help_is_reference_not_a_lab_notebook():
    """Figures and their history belong in docs/; a flag's help says what it does."""
    run = subprocess.run([sys.executable, "-m", "launch.async", "--help"], capture_output=True, text=True, timeout=60)
    text = " ".join(run.stdout.split())
    for pattern in (r"measured", r"\d ?×", r"\d+(\.\d+)? ?s in", r"traj/s", r"\d+(\.\d+)? ?%"):
        assert not re.search(pattern, text), f"--help carries a measurement: {re.search(pattern, text)[0]!r}"


def test_a_run_has_no_time_limit_unless_asked():
    assert Config().max_minutes == 0
