"""An actor's process killed mid-run, as an out-of-memory kill or a lost node would: the run restarts
it and reaches its step budget. An actor that raises is not restarted: tests/actors."""

import random
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from launch.plot import read_scalars

pytestmark = pytest.mark.slow


def actor_processes(job: psutil.Process) -> list[psutil.Process]:
    """The job's actor processes (Ray titles them "ray::ActorPart...")."""
    out = []
    for p in job.children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith("ray::ActorPart"):
                out.append(p)
        except psutil.Error:
            continue
    return out


def run_and_kill_an_actor(logdir, *args) -> tuple[int, str]:
    """A short run; once it has evaluated version 0, SIGKILL one of its two actors at a random
    moment of the next few seconds (in its constructor or its loop). (exit code, output)."""
    proc = subprocess.Popen([sys.executable, "-m", "launch.async", "--actors", "2", "--learners", "1",
                             "--steps", "8", "--learner.groups-per-step", "4", "--eval-episodes", "8",
                             "--logdir", str(logdir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.time() + 600
    for line in proc.stdout:
        seen.append(line)
        if "eval v0" in line:
            break  # the actors are starting or generating
        assert time.time() < deadline, "".join(seen[-20:])
    time.sleep(random.uniform(0, 4))
    victims = actor_processes(psutil.Process(proc.pid))
    assert len(victims) == 2, [p.cmdline() for p in victims]
    random.choice(victims).send_signal(signal.SIGKILL)
    rest, _ = proc.communicate(timeout=600)
    return proc.returncode, "".join(seen) + rest


def test_an_actor_killed_mid_run_is_restarted_and_the_run_reaches_its_budget(tmp_path):
    logdir = tmp_path / "killed"
    code, out = run_and_kill_an_actor(logdir)
    assert code == 0, out[-4000:]
    assert "done: 8 steps" in out
    assert "died" in out and "restarting it (1 of 3)" in out, out[-4000:]
    scalars = read_scalars(str(logdir))
    assert [s for s, _ in scalars["learner/loss"]] == list(range(1, 9))
    assert scalars["actors/restarts"][-1][1] == 1.0, out[-4000:]


def test_an_actor_that_dies_past_its_restarts_stops_the_run_with_a_message(tmp_path):
    code, out = run_and_kill_an_actor(tmp_path / "stopped", "--actor.restarts", "0")
    assert code != 0
    assert re.search(r"actor-\d died after 0 restart\(s\), the most --actor.restarts 0 allows", out), out[-4000:]
