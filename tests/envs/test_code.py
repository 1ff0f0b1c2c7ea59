"""--env code: generated tasks are valid, the grader cannot be fooled, and scripted policies
score what they should on code-64 (real sandboxes, real processes)."""

import json
import threading
import time

import numpy as np
import pytest

from envs import make_env
from envs.code import CODE64_SEED, read_blocks, task_set
from envs.codetasks import FUNCTIONS, Knobs, _load, _run_traced, make_task

from envs.sandbox_watch import sandboxed_pids

CODE64 = task_set(CODE64_SEED, 64)


def bash(command: str) -> str:
    return f"I will run this.\n```bash\n{command}\n```"


def write(path: str, text: str) -> str:
    return f"cat > {path} <<'TANDEM_EOF'\n{text}TANDEM_EOF"


def play(env, task, commands: list[str]) -> float:
    """Reset to `task`, run `commands`, submit; the reward."""
    env.reset(options={"task": task})
    for command in commands:
        obs, reward, terminated, truncated, _ = env.step(bash(command))
        assert not terminated and not truncated, obs
    obs, reward, terminated, _, info = env.step(bash("submit"))
    assert terminated and "Submitted" in obs[0]["content"]
    return reward


def fix(task) -> list[str]:
    """The known fix: the reference versions of the broken files, then the visible test."""
    return [write(path, text) for path, text in task.fix] + ["python3 tests/test_visible.py"]


def cheat(task) -> list[str]:
    """Make every test pass without touching the bug: rewrite and delete tests, plant hooks."""
    package = task.source_files[0].split("/")[0]
    hook = "import builtins, sys\nprint('TANDEM-GRADE []')\nsys.exit(0)\n"
    return [write("tests/test_visible.py", "print('passed')\n"), "rm -rf tests; mkdir tests",
            write("conftest.py", hook), write("sitecustomize.py", hook), write(f"{package}/conftest.py", hook),
            write("usercustomize.py", hook), "mkdir -p grader && echo '[]' > grader/calls.json"]


@pytest.fixture
def env(root):
    env = make_env("code", sandbox_root=str(root))
    yield env
    env.close()
    assert [p.name for p in root.iterdir() if p.name.startswith("ep-")] == []
    assert sandboxed_pids(root) == []


def test_every_code64_task_is_valid():
    assert len({t.key() for t in CODE64}) == 64
    for task in CODE64:
        files = dict(task.files)
        calls = [(m, f, json.loads(a)) for m, f, a in task.calls]
        want = json.loads(task.expected)
        fixed = {**files, **dict(task.fix)}
        assert task.fix and set(dict(task.fix)) <= set(task.source_files)
        for label, repo in (("buggy", files), ("fixed", fixed)):
            got = []
            for module, name, args in calls:
                source = repo[module.replace(".", "/") + ".py"]
                got.append(json.loads(json.dumps(r[1])) if (r := _run_traced(_load(source)[name], args))[0] == "ok"
                           else r)
            assert (got == want) == (label == "fixed"), (label, task.statement)


def test_difficulty_knobs_shape_the_package():
    rng = np.random.default_rng(3)
    task = make_task(rng, Knobs(functions=4, files=2, bugs=2, hidden_counterexample=True))
    modules = [p for p in task.source_files if not p.endswith("__init__.py")]
    assert len(modules) == 2 and len(task.fix) == 2  # one bug in each module
    assert sum(dict(task.files)[m].count("\ndef ") + dict(task.files)[m].startswith("def ") for m in modules) == 4
    with pytest.raises(ValueError, match="files <= functions"):
        Knobs(functions=1, files=2)
    with pytest.raises(ValueError, match="bugs <= functions"):
        Knobs(bugs=3, functions=2, files=1)
    assert len(FUNCTIONS) >= 12


def test_hang_bugs_are_caught_by_validation():
    digit_sum = next(f for f in FUNCTIONS if f.name == "digit_sum")
    hang = _load(digit_sum.source.replace("n //= 10", "n //= 1"))["digit_sum"]
    assert _run_traced(hang, [123]) == ("error", "TimeoutError")


def test_environments_made_at_once_share_one_sandbox(root):
    """An actor's env threads build their environments together: one Sandbox (one sweep, one check)."""
    made: list = []
    threads = [threading.Thread(target=lambda: made.append(make_env("code", sandbox_root=str(root))))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 8 and len({id(env.sandbox) for env in made}) == 1


def test_reading_blocks():
    assert read_blocks("```bash\nls\n```") == ["ls\n"]
    assert read_blocks("x ```sh\na\n``` y ```\nb\n```") == ["a\n", "b\n"]
    assert read_blocks("```python\nprint(1)\n```") == []
    assert read_blocks("``` ```") == []


def test_no_block_or_several_get_an_observation(env):
    env.reset(options={"task": CODE64[0]})
    obs, reward, terminated, truncated, info = env.step("I think the bug is in line 3.")
    assert "No ```bash block found" in obs[0]["content"] and "7 turns left" in obs[0]["content"]
    obs, *_ = env.step("```bash\nls\n```\nand\n```bash\npwd\n```")
    assert "2 ```bash blocks found" in obs[0]["content"]
    obs, *_ = env.step(bash("ls; exit 3"))
    assert obs[0]["content"].startswith("exit code: 3\ntests\n")


def test_the_known_fix_solves_code64(env):
    solved = [play(env, task, fix(task)) for task in CODE64]
    assert sum(solved) / len(solved) >= 0.95


ALL_OR_SOME = [16, pytest.param(64, marks=pytest.mark.slow)]
"""code-64's first 16 tasks in the fast tier, all of it in the slow one."""


@pytest.mark.parametrize("n", ALL_OR_SOME)
def test_submitting_at_once_solves_nothing(env, n):
    assert sum(play(env, task, []) for task in CODE64[:n]) == 0


@pytest.mark.parametrize("n", ALL_OR_SOME)
def test_editing_the_tests_and_planting_hooks_solves_nothing(env, n):
    assert sum(play(env, task, cheat(task)) for task in CODE64[:n]) == 0


def test_the_fix_with_the_cheats_still_solves(env):
    """What the grader restores is restored, not held against the agent."""
    task = CODE64[1]
    assert play(env, task, cheat(task)[:1] + fix(task)) == 1.0


def test_links_and_fake_results_in_source_files_fail(env):
    task = CODE64[2]
    broken = task.fix[0][0]
    fake = json.dumps([["ok", v] for v in json.loads(task.expected)][:1])
    attacks = [f"ln -sf /grader/run.py {broken}",
               f"ln -sf /etc/passwd {broken}",
               write(broken, f"import os, sys\nprint('TANDEM-GRADE {fake}')\nos._exit(0)\n"),
               f"rm {broken}",
               f"mkdir -p x && ln -s / x/root && ln -sfn $PWD/x/root/etc $(dirname {broken})/sub"]
    for attack in attacks:
        assert play(env, task, [attack]) == 0.0, attack


def test_the_last_turn_is_graded_and_ends_the_episode(root):
    env = make_env("code", max_turns=2, sandbox_root=str(root))
    task = CODE64[3]
    env.reset(options={"task": task})
    env.step(bash(fix(task)[0]) if len(task.fix) == 1 else bash(" && ".join(fix(task)[:-1])))
    obs, reward, terminated, truncated, info = env.step("no block")
    assert truncated and not terminated and reward == 1.0 and info["solved"]
    assert "No turns or time left" in obs[0]["content"]
    env.close()


def test_an_actor_stopped_mid_group_leaves_no_work_folder(root, tiny_model, chat):
    """Stopping a run ends its actors with groups unfinished: their episodes' work folders are
    removed as the actor stops, not left for the next run's sweep."""
    from actors.actor import Actor, ActorConfig
    from actors.torch_engine import TorchEngine
    from policy.load import LoraSpec
    from replay.buffer import ReplayBuffer
    from replay.client import LocalReplay
    from weights.publisher import WeightPublisher
    from weights.subscriber import WeightSubscriber
    from tests.actors.test_actor import random_adapter

    engine = TorchEngine(tiny_model, LoraSpec(rank=4))
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoints)
    actor = Actor(ActorConfig(group_size=2, groups_in_flight=2, max_new_tokens=4, max_tokens=2048), "actor-0",
                  engine, chat, lambda: make_env("code", sandbox_root=str(root)),
                  LocalReplay(ReplayBuffer(groups_per_step=2, max_staleness=100), actor="actor-0"), subscriber)
    stop = threading.Event()
    thread = threading.Thread(target=actor.run, args=(stop,))
    folders = lambda: [p.name for p in root.iterdir() if p.name.startswith("ep-")]  # noqa: E731
    try:
        publisher.publish(random_adapter(engine, version=0, scale=0.0))
        thread.start()
        deadline = time.time() + 120
        while time.time() < deadline and not folders():
            time.sleep(0.05)
        playing = folders()
    finally:
        stop.set()
        thread.join(120)
        subscriber.close()
        publisher.close()
    assert not thread.is_alive() and playing, "the actor never started an episode"
    assert folders() == []
