"""`--env dataset`: rows of a JSONL or Parquet file scored by a reward function of the user's
(envs/dataset.py). The reward module is a real file the test writes and imports; episodes are
played by the real torch engine on the tiny model. The whole job: the slow test at the end."""

import json
import subprocess
import sys

import pytest
from gymnasium.utils.env_checker import check_env

from actors.engine import SamplingParams
from actors.envrunner import EnvRunner
from actors.rollout import play, start
from actors.torch_engine import TorchEngine
from envs import make_env
from envs.dataset import DatasetEnv, RewardError
from launch.config import Config
from policy.load import LoraSpec

REWARDS = '''
import math


def exact(completion, row):
    """1 when the answer column appears in the completion."""
    return float(str(row["answer"]) in completion)


def verifier(completion, row, turn):
    """Multi-turn: feedback and another try until the answer is right."""
    if str(row["answer"]) in completion:
        return 1.0
    return 0.0, f"No (try {turn}). Answer with a number."


def flaky(completion, row):
    """0.5, or what each row's `kind` asks for: a raise, a string, NaN, None."""
    kind = row.get("kind", "")
    if kind == "raise":
        raise KeyError("grader lost its key")
    if kind == "text":
        return "1.0"
    if kind == "nan":
        return math.nan
    if kind == "none":
        return None
    return 0.5


def noisy(completion, row):
    """For the whole job: rewards that differ within a group, errors on some rows and on a third
    of every row's completions (so that the job's first groups hold errors whichever rows they draw)."""
    if row["kind"] == "raise" or len(completion) % 3 == 0:
        raise KeyError("grader lost its key")
    if row["kind"] == "text":
        return "1.0"
    return float(len(completion) % 2)


def mutate(completion, row):
    row["answer"] = "changed"
    return 1.0


not_callable = 3
'''


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    """A reward module (`tandem_rewards_test`) and a JSONL of 100 rows; returns the file's path."""
    (tmp_path / "tandem_rewards_test.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "prompts.jsonl"
    kinds = ["", "raise", "text", "nan", "none"]
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1, "kind": kinds[i % 5]}) + "\n"
                            for i in range(100)))
    return str(path)


def test_single_turn_rows_are_scored_by_the_function(rewards):
    env = DatasetEnv(rewards, "tandem_rewards_test:exact")
    check_env(env, skip_render_check=True)
    obs, info = env.reset(options={"row": 6})
    assert obs == ({"role": "user", "content": "What is 6 + 1?"},) and info == {"row": 6}
    assert env.step("It is 7.")[1:4] == (1.0, True, False)
    env.reset(options={"row": 6})
    assert env.step("It is 8.")[1:3] == (0.0, True)


def test_the_contract_seeds_and_hostile_actions(rewards):
    """What tests/envs/test_contract.py checks of the built-in environments."""
    from tests.envs.test_contract import HOSTILE, key

    first = [key(DatasetEnv(rewards, "tandem_rewards_test:exact").reset(seed=s)[0]) for s in range(6)]
    assert first == [key(DatasetEnv(rewards, "tandem_rewards_test:exact").reset(seed=s)[0]) for s in range(6)]
    assert len(set(first)) > 1
    env = DatasetEnv(rewards, "tandem_rewards_test:exact")
    for action in HOSTILE:
        env.reset(seed=1)
        obs, reward, terminated, _, _ = env.step(action)
        assert env.observation_space.contains(obs) and reward in (0.0, 1.0) and terminated


def test_chat_prompts_and_a_system_message(tmp_path, rewards):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": 1}) + "\n")
    env = DatasetEnv(str(path), "tandem_rewards_test:exact", system="Be brief.")
    obs, _ = env.reset(seed=0)
    assert [m["role"] for m in obs] == ["system", "user"] and obs[0]["content"] == "Be brief."


def test_a_verifier_gives_feedback_and_another_try_until_max_turns(rewards):
    env = DatasetEnv(rewards, "tandem_rewards_test:verifier", max_turns=3)
    env.reset(options={"row": 10})
    obs, reward, terminated, truncated, info = env.step("5")
    assert (obs[0]["content"], reward, terminated, truncated) == ("No (try 1). Answer with a number.", 0.0, False, False)
    assert info == {"row": 10, "turn": 1}
    assert env.step("11")[1:4] == (1.0, True, False)  # right at the second try
    env.reset(options={"row": 10})
    env.step("1"), env.step("2")
    assert env.step("3")[2:4] == (False, True)  # three wrong answers: truncated


@pytest.mark.parametrize("row, error", [(1, r"raised KeyError\('grader lost its key'\)"),
                                        (2, r"returned '1.0', not a finite number"),
                                        (3, r"returned nan, not a finite number"),
                                        (4, r"returned None, not a finite number")])
def test_a_reward_that_raises_or_is_not_a_number_is_an_environment_error(rewards, row, error):
    env = DatasetEnv(rewards, "tandem_rewards_test:flaky")
    env.reset(options={"row": row})
    with pytest.raises(RewardError, match=rf"--dataset.reward tandem_rewards_test:flaky on row {row} {error}"):
        env.step("anything")


def test_the_reward_cannot_change_the_task(rewards):
    env = DatasetEnv(rewards, "tandem_rewards_test:mutate")
    env.reset(options={"row": 0})
    with pytest.raises(RewardError, match="TypeError"):
        env.step("x")


def test_bad_reward_errors_end_only_their_episodes_in_a_real_rollout(tiny_model, chat, rewards):
    """Rows 0-4: a reward of 0.5, a raise, a string, NaN, None; played by the torch engine."""
    engine = TorchEngine(tiny_model, LoraSpec(rank=4))
    runner = EnvRunner(timeout_s=10.0, threads=2)
    episodes = [start(DatasetEnv(rewards, "tandem_rewards_test:flaky"), chat, runner, options={"row": i})
                for i in range(5)]
    try:
        play(engine, chat, episodes, SamplingParams(4, chat.stop_ids), 512, runner)
    finally:
        runner.close()
    assert [e.finish_reason for e in episodes] == ["terminated"] + ["env_error"] * 4
    assert episodes[0].reward == 0.5 and "RewardError" in episodes[1].error
    for e in episodes[1:]:
        assert e.trajectory().mask.sum() == 0  # recorded, not trained on


def test_evaluation_rows_are_held_out_or_another_file(tmp_path, rewards):
    env = DatasetEnv(rewards, "tandem_rewards_test:exact")
    held = [t["row"] for t in env.eval_tasks(env.eval_seed, 64)]
    assert len(held) == 20 == len(set(held))  # min(64, 100 // 5)
    drawn = set()
    for seed in range(300):
        env.reset(seed=seed)
        drawn.add(env.index)
    assert not drawn & set(held) and len(drawn) > 60
    other = tmp_path / "eval.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(7)))
    env = DatasetEnv(rewards, "tandem_rewards_test:exact", eval_path=str(other))
    tasks = env.eval_tasks(env.eval_seed, 64)
    assert len(tasks) == 7 and env.reset(options=tasks[0])[0][0]["content"].startswith("q")


def test_parquet_rows(tmp_path, rewards):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 2 + 2?", "answer": 4}] * 10), str(path))
    env = make_env("dataset", path=str(path), reward="tandem_rewards_test:exact")
    env.reset(seed=1)
    assert env.step("4")[1] == 1.0


@pytest.mark.parametrize("section, message", [
    ({}, "--env dataset needs --dataset.path"),
    ({"path": "/no/such.jsonl", "reward": "m:f"}, r"--dataset.path '/no/such.jsonl': no such file"),
    ({"reward": "tandem_rewards_test"}, "give module:function"),
    ({"reward": "tandem_rewards_test:nothere"}, "cannot import nothere from tandem_rewards_test"),
    ({"reward": "no_such_module_xyz:f"}, "cannot import f from no_such_module_xyz"),
    ({"reward": "tandem_rewards_test:not_callable"}, "is not a function"),
    ({"max_turns": 0}, "--dataset.max-turns must be at least 1"),
])
def test_bad_dataset_flags_name_the_flag(rewards, section, message):
    from launch.envconfig import DatasetConfig

    with pytest.raises(ValueError, match=message):
        Config(env="dataset", dataset=DatasetConfig(**{"path": rewards, "reward": "tandem_rewards_test:exact",
                                                       **section}) if section else DatasetConfig())


@pytest.mark.slow
def test_a_dataset_run_goes_on_through_reward_errors(tmp_path, rewards):
    """The whole job on the tiny model: a fifth of the rows' rewards raise, a fifth return a string,
    and a third of the other completions raise too; the run still makes its 2 steps, counting the errors."""
    from launch.plot import read_scalars

    run = subprocess.run([sys.executable, "-m", "launch.async", "--env", "dataset", "--dataset.path", rewards,
                          "--dataset.reward", "tandem_rewards_test:noisy", "--steps", "2", "--actors", "2",
                          "--learners", "1", "--eval-episodes", "4", "--learner.groups-per-step", "2",
                          "--actor.group-size", "4", "--logdir", str(tmp_path / "run")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 2 steps" in run.stdout
    scalars = read_scalars(str(tmp_path / "run"))
    assert scalars["rollout/env_errors"][-1][1] > 0


def test_the_docs_worked_example_scores_and_its_commands_parse(tmp_path, monkeypatch):
    """docs/datasets.md's two files, saved as the doc says; its commands parse into valid configs
    (the file exists, the reward imports) and its rewards score as described."""
    import re
    import shlex
    from pathlib import Path

    import tyro

    doc = (Path(__file__).resolve().parents[2] / "docs" / "datasets.md").read_text()
    for source, name in re.findall(r"```python\n(# (\w+\.py).*?)```", doc, re.DOTALL):
        (tmp_path / name).write_text(source)
    subprocess.run([sys.executable, "make_prompts.py"], cwd=tmp_path, check=True, timeout=60)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    commands = [c for block in re.findall(r"```bash\n(.*?)```", doc, re.DOTALL) for c in block.splitlines()
                if c.startswith("python -m launch.async")]
    assert len(commands) == 4
    for command in commands:
        cfg = tyro.cli(Config, args=shlex.split(command)[3:])
        assert cfg.env == "dataset" and cfg.dataset.path == "prompts.jsonl"
    env = DatasetEnv("prompts.jsonl", "rewards:score")
    env.reset(options={"row": 0})
    answer = env.row["answer"]
    assert env.step(f"It is {answer}.")[1] == 1.0
    env = DatasetEnv("prompts.jsonl", "rewards:verifier", max_turns=3)
    env.reset(options={"row": 0})
    assert env.step(str(answer - 1))[0][0]["content"] == "Too small."
    assert env.step("no idea")[0][0]["content"] == "Answer with a number."
    assert env.step(str(answer))[1:3] == (1.0, True)
