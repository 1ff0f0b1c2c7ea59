"""What the sandbox costs: start-up of one sandboxed command against the same command bare, and
code episodes per second with many at once against the same episodes run bare, in one run.

    python -m bench.sandbox

An episode is code-64's known fix played through `--env code` (reset, one command per fixed
file, the visible test, submit and grading in a fresh sandbox); bare, the same commands run
with `bash -c` in a temporary folder and the grader with `python3`, no sandbox. Also the
actor's own CPU per sandboxed command (bwrap start, reading output, the memory watcher).
Results and the machine they came from: docs/sandbox.md. Ends with one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tyro


@dataclass
class Args:
    starts: int = 100
    """Start-ups timed for each of sandboxed and bare (the median is reported)."""
    episodes: int = 64
    """Episodes for each of sandboxed and bare (code-64's tasks, in order, repeated)."""
    at_once: int = 16
    """Episodes running concurrently."""
    command: str = "true"
    """The command whose start-up is timed."""


def startups(args: Args) -> tuple[float, float, float]:
    """Median seconds to run `args.command` sandboxed and bare, and the actor's CPU per sandboxed one."""
    from envs.sandbox import Sandbox

    sandbox = Sandbox()
    sandboxed, bare, cpu = [], [], 0.0
    with sandbox.episode() as ep, tempfile.TemporaryDirectory() as folder:
        for _ in range(args.starts):  # interleaved, so both see the same machine
            t, c = time.perf_counter(), time.process_time()
            ep.run(args.command)
            sandboxed.append(time.perf_counter() - t)
            cpu += time.process_time() - c  # this process's CPU only: the watcher thread's too
            t = time.perf_counter()
            subprocess.run(["/bin/bash", "-c", args.command], cwd=folder, stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=60, env=_bare_env(folder))
            bare.append(time.perf_counter() - t)
    return statistics.median(sandboxed), statistics.median(bare), cpu / args.starts


def _bare_env(work: str) -> dict:
    """What a sandboxed command's environment holds (so `python3` is the same /usr/bin/python3, not
    a version manager's shim on the host's PATH)."""
    return {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1"}


def _commands(task) -> list[str]:
    writes = [f"cat > {path} <<'TANDEM_EOF'\n{text}TANDEM_EOF" for path, text in task.fix]
    return writes + ["python3 tests/test_visible.py"]


def sandboxed_episode(task) -> float:
    from envs import make_env

    env = make_env("code")
    try:
        env.reset(options={"task": task})
        for command in _commands(task):
            env.step(f"```bash\n{command}\n```")
        return env.step("```bash\nsubmit\n```")[1]
    finally:
        env.close()


def bare_episode(task) -> float:
    from envs.code import MARK, RUNNER, check
    from envs.sandbox import WORKDIR, Result

    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory() as grader:
        for path, text in task.files:
            Path(work, path).parent.mkdir(parents=True, exist_ok=True)
            Path(work, path).write_text(text)
        for command in _commands(task):
            subprocess.run(["/bin/bash", "-c", command], cwd=work, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=60, env=_bare_env(work))
        Path(grader, "run.py").write_text(RUNNER.replace(f'"{WORKDIR}"', repr(work)).replace(
            '"/grader/calls.json"', repr(os.path.join(grader, "calls.json"))))
        Path(grader, "calls.json").write_text(json.dumps(task.calls))
        run = subprocess.run(["python3", "-I", "-S", os.path.join(grader, "run.py")], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=60, env=_bare_env(work))
        assert MARK in run.stdout, run.stderr
        return float(check(Result(run.returncode, run.stdout), task.expected)[0])


def episodes_per_s(play, tasks: list, at_once: int) -> tuple[float, float]:
    """(episodes per second, share solved) of `tasks` played `at_once` at a time."""
    with ThreadPoolExecutor(at_once) as pool:
        t = time.perf_counter()
        rewards = list(pool.map(play, tasks))
        seconds = time.perf_counter() - t
    return len(tasks) / seconds, sum(rewards) / len(rewards)


def measure(args: Args) -> dict:
    from envs.code import CODE64_SEED, task_set

    sandboxed_s, bare_s, actor_cpu_s = startups(args)
    code64 = task_set(CODE64_SEED, 64)
    tasks = [code64[i % 64] for i in range(args.episodes)]
    bare_rate, bare_solved = episodes_per_s(bare_episode, tasks, args.at_once)
    rate, solved = episodes_per_s(sandboxed_episode, tasks, args.at_once)
    return {"startup_ms_sandboxed": round(sandboxed_s * 1e3, 2), "startup_ms_bare": round(bare_s * 1e3, 2),
            "startup_ratio": round(sandboxed_s / bare_s, 2), "actor_cpu_ms_per_command": round(actor_cpu_s * 1e3, 2),
            "at_once": args.at_once, "episodes": args.episodes,
            "episodes_per_s_sandboxed": round(rate, 2), "episodes_per_s_bare": round(bare_rate, 2),
            "episodes_ratio": round(bare_rate / rate, 2), "solved_sandboxed": solved, "solved_bare": bare_solved,
            "cpus": os.cpu_count()}


def main() -> None:
    args = tyro.cli(Args)
    figures = measure(args)
    print(f"start-up of `{args.command}`: {figures['startup_ms_sandboxed']} ms sandboxed, "
          f"{figures['startup_ms_bare']} ms bare ({figures['startup_ratio']}x); the actor's CPU per sandboxed "
          f"command: {figures['actor_cpu_ms_per_command']} ms")
    print(f"{args.episodes} code episodes, {args.at_once} at once: {figures['episodes_per_s_sandboxed']}/s "
          f"sandboxed, {figures['episodes_per_s_bare']}/s bare (solved {figures['solved_sandboxed']:.0%} and "
          f"{figures['solved_bare']:.0%})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
