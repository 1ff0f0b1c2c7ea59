"""skyrl-gym's own environments run unchanged behind our contract, with tasks from local files."""

import json

import pytest
from gymnasium.utils.env_checker import check_env

from envs import make_env

pytest.importorskip("skyrl_gym")


def gsm8k_rows(n: int = 20) -> list[dict]:
    """Rows in SkyRL's dataset format (what its gsm8k preprocessing script writes)."""
    return [{"prompt": [{"role": "user", "content": f"Tom has {i} apples and buys {i + 2} more. How many? "
                         "End with '#### <answer>'."}],
             "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": str(2 * i + 2)},
             "extra_info": {"index": i, "max_turns": 3}} for i in range(n)]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_gsm8k_from_jsonl_passes_the_checker_and_rewards_the_right_answer(tmp_path):
    tasks = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows())
    env = make_env("skyrl:gsm8k", tasks=tasks)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(options={"row": 5})
    assert "Tom has 5 apples" in obs[0]["content"]
    _, reward, terminated, _, _ = env.step("5 + 7 = 12\n#### 12")
    assert (reward, terminated) == (1.0, True)
    env.reset(options={"row": 5})
    assert env.step("#### 13")[1] == 0.0
    env.close()


def test_multi_turn_env_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(gsm8k_rows()), path)
    env = make_env("skyrl:gsm8k_multi_turn", tasks=str(path))
    env.reset(options={"row": 2})
    obs, reward, terminated, _, _ = env.step("I think it is 5")
    assert not terminated and "####" in obs[0]["content"]  # the environment's own follow-up
    obs, reward, terminated, _, _ = env.step("#### 6")
    assert (reward, terminated) == (1.0, True)


def test_evaluation_rows_are_held_out_of_training(tmp_path):
    tasks = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(50))
    env = make_env("skyrl:gsm8k", tasks=tasks)
    held = {t["row"] for t in env.eval_tasks(env.eval_seed, 64)}
    assert len(held) == 10  # a fifth of 50 rows
    drawn = {env.reset(seed=s)[1]["row"] for s in range(300)}
    assert drawn and not drawn & held


def test_bad_task_files_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        make_env("skyrl:gsm8k", tasks=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON object"):
        make_env("skyrl:gsm8k", tasks=str(bad))
    with pytest.raises(ValueError, match="unknown skyrl-gym environment 'chess'"):
        make_env("skyrl:chess", tasks=write_jsonl(tmp_path / "ok.jsonl", gsm8k_rows(2)))
