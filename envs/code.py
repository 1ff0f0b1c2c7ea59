"""Coding agents: fix a bug in a repository by running shell commands in a sandbox.

Design decisions:
- Each reply must hold exactly one fenced ```bash block (the format SWE-agent-style agents
  use); it runs in a fresh sandbox (envs/sandbox.py) over the episode's work folder, and its
  exit code and output (head and tail) are the next observation. No block, or several, gets
  an observation saying so. A block that is only `submit` ends the episode; so does the last
  turn or the episode's time budget, and the work is graded as it stands.
- Grading is SWE-bench's: a fresh grading folder holds the pristine repository, only the
  agent's versions of the task's source files are copied in (tests and everything else
  restored; files are read without following links), and the hidden calls run in a fresh
  sandbox under `python3 -I`. The results printed are compared here with the reference's:
  reward 1.0 if all match, else 0. An exit code or a printed "passed" proves nothing.
- Step and grading deadlines stay below the actor's environment time limit (launch checks
  it), so the actor never abandons a command that is still running.
- Tasks are generated (envs/codetasks.py); code-64 is 64 distinct tasks from `CODE64_SEED`,
  never drawn in training. The sandbox runs the host's /usr/bin/python3 (see docs/sandbox.md).
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import TextEnv, distinct_tasks
from envs.codetasks import Knobs, Task, make_task
from envs.sandbox import WORKDIR, Episode, Limits, Result, Sandbox, SandboxConfig
from envs.swebench import SweTask, read_rows
from envs.swebench import grade as grade_swe

CODE64_SEED = 32032
_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_SHELLS = ("bash", "sh", "shell", "")
MARK = "TANDEM-GRADE "
CALL_S = 0.5
"""CPU time of one hidden call (so a loaded machine does not fail it); the first call past it
skips the rest (a hang fails anyway)."""
RUNNER = f"""import importlib, json, signal, sys
sys.path.insert(0, "{WORKDIR}")
def timeout(*_):
    raise TimeoutError
signal.signal(signal.SIGVTALRM, timeout)
out = []
for module, name, args in json.load(open("/grader/calls.json")):
    if out and out[-1] == ["error", "TimeoutError"]:
        out.append(["error", "skipped"])
        continue
    try:
        signal.setitimer(signal.ITIMER_VIRTUAL, {CALL_S})
        out.append(["ok", getattr(importlib.import_module(module), name)(*json.loads(args))])
    except BaseException as exc:
        out.append(["error", type(exc).__name__])
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
sys.stdout.write("\\n{MARK}" + json.dumps(out) + "\\n")
"""


_FIRST_USE = threading.Lock()
"""Held while the caches below are looked up: an actor's env threads reset their episodes at once,
and without it each built its own Sandbox (a sweep, a check in a sandbox) and held-out set."""


def shared_sandbox(cfg: SandboxConfig) -> Sandbox:
    """One `Sandbox` per configuration in a process (checked once, its leftovers swept once)."""
    with _FIRST_USE:
        return _sandbox(cfg)


@functools.lru_cache(maxsize=8)
def _sandbox(cfg: SandboxConfig) -> Sandbox:
    return Sandbox(cfg)


def task_set(seed: int, n: int, knobs: Knobs = Knobs()) -> list[Task]:
    return distinct_tasks(lambda rng: make_task(rng, knobs), seed, n)


def _held_out(knobs: Knobs) -> frozenset[str]:
    with _FIRST_USE:
        return _held_out_keys(knobs)


@functools.lru_cache(maxsize=4)
def _held_out_keys(knobs: Knobs) -> frozenset[str]:
    return frozenset(t.key() for t in task_set(CODE64_SEED, 64, knobs))


def read_blocks(text: str) -> list[str]:
    """The shell blocks of a reply (```bash, ```sh, ```shell or an unlabelled fence)."""
    return [body for lang, body in _BLOCK.findall(text) if lang.lower() in _SHELLS]


class CodeEnv(TextEnv):
    """Fix the bug in a repository, one shell command a turn: a generated package, or with `tasks`
    and `repos` the rows of a SWE-bench-format file (envs/swebench.py).

    `reset(seed=s)` draws a task from `s`; `options={"task": Task}` or `{"row": i}` plays that one.
    """

    eval_seed = CODE64_SEED

    def __init__(self, max_turns: int = 8, command_s: float = 10.0, cpu_s: int = 0, grade_s: float = 15.0,
                 episode_s: float = 120.0, memory_mb: int = 1024, output_chars: int = 2000,
                 functions: int = 1, files: int = 1, bugs: int = 1, hidden_counterexample: bool = False,
                 sandbox_root: str = "", tasks: str = "", repos: str = "", rootfs: str = "",
                 ro_binds: tuple[str, ...] = (), python: str = "python3") -> None:
        super().__init__()
        if max_turns < 1 or min(command_s, grade_s, episode_s) <= 0 or output_chars < 200:
            raise ValueError("max_turns must be at least 1, the time limits positive and output_chars at least 200")
        self.max_turns, self.episode_s = max_turns, episode_s
        self.knobs = Knobs(functions, files, bugs, hidden_counterexample)
        self.limits = Limits(wall_s=command_s, cpu_s=cpu_s or max(1, int(command_s)), memory_mb=memory_mb,
                             output_bytes=output_chars)
        self.grade_limits = Limits(wall_s=grade_s, cpu_s=max(1, int(grade_s)), memory_mb=memory_mb,
                                   output_bytes=1 << 20)
        self.sandbox = shared_sandbox(SandboxConfig(root=sandbox_root, rootfs=rootfs, ro_binds=tuple(ro_binds)))
        self.rows = read_rows(tasks, repos) if tasks else ()
        self.python = python
        order = np.random.default_rng(CODE64_SEED).permutation(len(self.rows))
        self.held_rows = [int(i) for i in order[: min(64, len(self.rows) // 5)]]
        self.train_rows = [i for i in range(len(self.rows)) if i not in self.held_rows] or list(range(len(self.rows)))
        self.task: Task | SweTask | None = None
        self.episode: Episode | None = None
        self.turns, self.used_s = 0, 0.0

    def eval_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        """Generated: n distinct tasks from `seed`. Rows: at the evaluation seed the held-out rows (at
        most 64, a fifth of the file), at any other seed n rows drawn from it."""
        if not self.rows:
            return [{"task": t} for t in task_set(seed, n, self.knobs)]
        order = self.held_rows if seed == CODE64_SEED else np.random.default_rng(seed).permutation(len(self.rows))
        return [{"row": int(i)} for i in list(order)[:n]]

    def rules(self) -> str:
        return (f"Rules: reply with exactly one ```bash block per turn. It runs in a new bash shell in {WORKDIR} (the "
                "repository; files you change there persist, processes and /tmp do not), with no network and a "
                f"limit of {self.limits.wall_s:g} s. Its exit code and output come back. When the bug is fixed, "
                "reply with a block holding only `submit`. Only changes to source files are graded; "
                f"tests are restored first. You have {self.max_turns} turns; the last one is graded as it stands.")

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        task = options.get("task")
        if task is not None and not isinstance(task, Task):
            raise TypeError("options['task'] must be an envs.codetasks.Task")
        if self.rows and task is None:
            row = options.get("row", self.train_rows[int(self.np_random.integers(len(self.train_rows)))])
            task = self.rows[int(row)]
        while task is None or ("task" not in options and task.key() in _held_out(self.knobs)):
            task = make_task(self.np_random, self.knobs)
        self._close_episode()
        self.task, self.turns, self.used_s = task, 0, 0.0
        self.episode = self.sandbox.episode()
        match task:
            case Task():
                for path, text in task.files:
                    self.episode.write(path, text)
            case SweTask():
                self.episode.copy_in(task.repo)
        return f"{task.prompt()}\n{self.rules()}", {}

    def _step(self, text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.task is None or self.episode is None:
            raise RuntimeError("call reset() before step()")
        self.turns += 1
        left = self.max_turns - self.turns
        info: dict[str, Any] = {"turns": self.turns}
        blocks = read_blocks(text)
        if len(blocks) == 1 and blocks[0].strip() == "submit":
            return self._finish("Submitted.", info, truncated=False)
        if len(blocks) != 1:
            obs = ("No ```bash block found" if not blocks else f"{len(blocks)} ```bash blocks found") + \
                  ": reply with exactly one ```bash block (or one holding only `submit`)."
        else:
            limits = replace(self.limits, wall_s=max(min(self.limits.wall_s, self.episode_s - self.used_s), 0.1))
            result = self.episode.run(blocks[0], limits)
            self.used_s += result.seconds
            info["exit_code"] = result.exit_code
            obs = describe(result)
        if left <= 0 or self.used_s >= self.episode_s:
            return self._finish(obs + "\nNo turns or time left: graded as it stands.", info, truncated=True)
        return f"{obs}\n({left} turn{'s' if left != 1 else ''} left)", 0.0, False, False, info

    def _finish(self, obs: str, info: dict[str, Any], truncated: bool):
        solved, why = self.grade()
        info.update(solved=solved, grade=why)
        self._close_episode()
        return f"{obs}\n{'Solved' if solved else 'Not solved'}: {why}.", float(solved), not truncated, truncated, info

    def grade(self) -> tuple[bool, str]:
        """Whether the hidden tests pass on the pristine repository with the agent's source files,
        and a short reason."""
        assert self.task is not None and self.episode is not None
        match self.task:
            case SweTask() as task:
                return grade_swe(task, self.sandbox, self.episode, self.grade_limits, self.python)
            case task:
                return self._grade_generated(task)

    def _grade_generated(self, task: Task) -> tuple[bool, str]:
        with self.sandbox.episode() as grading, tempfile.TemporaryDirectory(prefix="tandem-grader-") as hidden:
            for path, text in task.files:
                if path not in task.source_files:
                    grading.write(path, text)
            for path in task.source_files:
                mine = self.episode.read(path)
                if mine is not None:
                    grading.write(path, mine)
            Path(hidden, "run.py").write_text(RUNNER)
            Path(hidden, "calls.json").write_text(json.dumps(task.calls))
            os.chmod(hidden, 0o755)
            result = grading.run("exec python3 -I -S /grader/run.py", self.grade_limits, binds=((hidden, "/grader"),))
        return check(result, task.expected)

    def _close_episode(self) -> None:
        if self.episode is not None:
            self.episode.close()
            self.episode = None

    def close(self) -> None:
        self._close_episode()


def check(result: Result, expected: str) -> tuple[bool, str]:
    """Whether a grading run's printed results equal `expected` (JSON), and why not."""
    if result.killed:
        return False, f"the hidden tests were killed ({result.killed})"
    lines = [line for line in result.output.splitlines() if line.startswith(MARK)]
    if not lines:
        return False, "the hidden tests did not finish"
    try:
        got = json.loads(lines[-1][len(MARK):])
    except ValueError:
        return False, "the hidden tests did not finish"
    if not isinstance(got, list):
        return False, "the hidden tests did not finish"
    want = [["ok", v] for v in json.loads(expected)]
    failed = sum(g != w for g, w in zip(got, want)) + abs(len(got) - len(want))
    return (True, "all hidden tests pass") if failed == 0 else (False, f"{failed} of {len(want)} hidden tests fail")


def describe(result: Result) -> str:
    """A command's result as the model sees it."""
    head = f"exit code: {result.exit_code}"
    if result.timed_out:
        head += " (killed: the time limit passed)"
    elif result.out_of_memory:
        head += " (killed: the memory budget was exceeded)"
    return f"{head}\n{result.output.rstrip()}" if result.output.strip() else f"{head}\n(no output)"
