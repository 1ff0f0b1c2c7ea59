"""bench.sandbox measures what it says, on a few commands and episodes (the figures themselves
are in docs/sandbox.md; tests never assert times)."""

import json
import subprocess
import sys

import pytest

from bench.sandbox import Args, bare_episode, measure, sandboxed_episode
from envs.code import CODE64_SEED, task_set


def test_bare_and_sandboxed_episodes_solve_the_same_tasks():
    for task in task_set(CODE64_SEED, 3):
        assert bare_episode(task) == sandboxed_episode(task) == 1.0


def test_the_figures_are_reported():
    figures = measure(Args(starts=3, episodes=4, at_once=2))
    assert figures["solved_sandboxed"] == figures["solved_bare"] == 1.0
    for key in ("startup_ms_sandboxed", "startup_ms_bare", "startup_ratio", "episodes_per_s_sandboxed",
                "episodes_per_s_bare", "episodes_ratio", "actor_cpu_ms_per_command"):
        assert figures[key] > 0, key


@pytest.mark.slow
def test_the_bench_runs_and_ends_with_one_json_line():
    run = subprocess.run([sys.executable, "-m", "bench.sandbox", "--starts", "20", "--episodes", "16"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["at_once"] == 16 and figures["solved_sandboxed"] == 1.0
