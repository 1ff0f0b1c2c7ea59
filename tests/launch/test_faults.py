"""Parts of a real run (real Ray, real processes) SIGKILLed at a random moment, as a lost node, an
out-of-memory kill or a preempted machine would: the run reaches its step budget, versions only go
up, no group is trained twice, and every group replay acknowledged to an actor is trained on,
dropped as stale, or still buffered at the end. Kills share runs where their checks allow. (Parts
that die past their restarts, as the driver sees them: tests/launch/test_supervise.py.)"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from launch.plot import read_scalars
from replay.log import history

pytestmark = pytest.mark.slow

STEPS = 7
RUN = ["--actors", "2", "--learners", "2", "--steps", str(STEPS), "--learner.groups-per-step", "4",
       "--eval-episodes", "8", "--checkpoint-every", "3", "--replay.keep-log"]


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launch.async", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def published(logdir: Path) -> int:
    try:
        return int((logdir / "checkpoints" / "published").read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def wait_for_version(proc: subprocess.Popen, logdir: Path, version: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while published(logdir) < version:
        assert proc.poll() is None, f"the run ended before version {version}: {proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, f"no version {version} within {timeout} s"
        time.sleep(0.2)


def kill_part(proc: subprocess.Popen, title: str) -> None:
    """SIGKILL one of the run's processes whose title starts with `title` (e.g. "ray::LearnerPart")."""
    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith(title):
                found.append(p)
        except psutil.Error:
            continue
    assert found, f"no {title} process"
    random.choice(found).send_signal(signal.SIGKILL)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the driver, as a lost machine would, and wait for its parts to end (Ray's workers end
    with its raylet, which ends with the driver); any still there after a minute are killed. Ray's
    dashboard and runtime-env agents can outlive the raylet: they are killed once the rest is gone."""
    parts, agents = [], []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            (agents if p.name().endswith("Agent") else parts).append(p)
        except psutil.NoSuchProcess:
            continue
    proc.kill()
    proc.communicate(timeout=60)
    _, alive = psutil.wait_procs(parts, timeout=60)
    for p in alive + agents:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue


def finish(proc: subprocess.Popen, seen: str = "") -> str:
    out, _ = proc.communicate(timeout=900)
    out = seen + out
    assert proc.returncode == 0, out[-5000:]
    assert f"done: {STEPS} steps" in out, out[-3000:]
    return out


def dropped_counted(points: list) -> float:
    """The stale drops counted in TensorBoard, over every replay process (a restarted one counts from 0)."""
    total, last = 0.0, 0.0
    for _, value in points:
        total += value - last if value >= last else value
        last = value
    return total


def audit(logdir: Path, count_drops: bool = True) -> dict:
    """The run's promises, from its run directory; returns what it found."""
    scalars = read_scalars(str(logdir))
    for tag, points in scalars.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), f"{tag}: a step written twice or out of order: {steps}"
    assert scalars["learner/step"][-1][1] == STEPS
    trained = Counter()
    for path in sorted((logdir / "trained").glob("rank-*.jsonl")):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        versions = [x["version"] for x in lines]
        assert versions == sorted(set(versions)), f"{path.name}: versions not strictly increasing: {versions}"
        assert lines[-1]["step"] == STEPS
        trained.update(g for x in lines for g in x["groups"])
    twice = [g for g, n in trained.items() if n > 1]
    assert not twice, f"groups trained twice: {twice}"
    log = history(logdir / "replay-log")
    assert log["complete"], "the replay log lost its first segment: the audit needs the whole history"
    stored = set(log["stored"])
    assert len(log["stored"]) == len(stored)
    # Replay records a shard as trained before the learner hears so (and writes its record).
    assert set(trained) <= set(log["trained"]), "a group trained on that replay never stored or consumed"
    untrained = stored - set(log["trained"])
    dropped, buffered = untrained & log["dropped"], untrained - log["dropped"]
    assert not log["dropped"] & set(log["trained"])
    if count_drops:
        assert len(dropped) <= dropped_counted(scalars.get("replay/dropped_stale", [])), "a drop not counted"
    return {"trained": len(log["trained"]), "dropped": len(dropped), "buffered": len(buffered), "scalars": scalars}


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 600) -> str:
    """The job's output up to and including its first line holding `text`."""
    seen, deadline = [], time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return "".join(seen)
        assert time.time() < deadline, "".join(seen[-20:])
    raise AssertionError(f"the run ended before printing {text!r}: {''.join(seen)[-3000:]}")


def test_an_actor_then_the_replay_service_killed_mid_run_are_brought_back_and_no_step_is_lost(tmp_path):
    """The actor just after version 0 is evaluated (in its constructor or its loop, at random),
    the replay service at a later version: each is restarted once, and every step is trained."""
    logdir = tmp_path / "run"
    proc = start(*RUN, "--logdir", str(logdir))
    seen = wait_for_line(proc, "eval v0")  # the actors are starting or generating
    time.sleep(random.uniform(0, 4))
    kill_part(proc, "ray::ActorPart")
    wait_for_version(proc, logdir, random.randint(2, 4))
    time.sleep(random.uniform(0, 2))
    kill_part(proc, "ray::ReplayPart")
    out = finish(proc, seen)
    assert re.search(r"actor-\d died .*restarting it \(1 of 3\)", out), out[-4000:]
    assert re.search(r"the replay service died .*its log brings back every stored group \(1 of 3\)", out), out[-4000:]
    # Drops the killed replay counted after its last report are not in TensorBoard: not compared.
    found = audit(logdir, count_drops=False)
    assert found["scalars"]["actors/restarts"][-1][1] == 1.0
    assert found["scalars"]["replay/restarts"][-1][1] == 1.0
    assert [s for s, _ in found["scalars"]["learner/loss"]] == list(range(1, STEPS + 1))


def test_an_actor_then_a_learner_rank_killed_mid_run_are_brought_back_and_nothing_is_trained_twice(tmp_path):
    logdir = tmp_path / "run"
    proc = start(*RUN, "--logdir", str(logdir))
    wait_for_version(proc, logdir, random.randint(1, 2))
    time.sleep(random.uniform(0, 2))
    kill_part(proc, "ray::ActorPart")
    wait_for_version(proc, logdir, random.randint(3, 4))
    time.sleep(random.uniform(0, 2))
    kill_part(proc, "ray::LearnerPart")
    out = finish(proc)
    assert re.search(r"actor-\d died .*restarting it \(1 of 3\)", out), out[-4000:]
    assert re.search(r"a learner rank died .*went back to its newest checkpoint \(1 of 2 restarts\)", out), \
        out[-4000:]
    found = audit(logdir)
    assert found["scalars"]["actors/restarts"][-1][1] == 1.0
    assert found["scalars"]["learner/restarts"][-1][1] == 1.0


def test_a_killed_driver_leaves_a_run_that_resume_finishes(tmp_path):
    logdir = tmp_path / "run"
    proc = start(*RUN, "--logdir", str(logdir))
    wait_for_version(proc, logdir, random.randint(2, 3))  # then 4+ steps: the waiting groups are served
    time.sleep(random.uniform(0, 2))
    kill_job(proc)
    before = published(logdir)
    at_kill = history(logdir / "replay-log")
    waiting = set(at_kill["stored"]) - at_kill["consumed"]  # acknowledged to actors, not trained on
    out = finish(start("--resume", str(logdir)))
    assert f"{STEPS} steps" in out
    found = audit(logdir, count_drops=False)  # the first replay's last drops died with the driver
    after = history(logdir / "replay-log")
    # Served after the resume (oldest first), or dropped as too stale for the resumed versions.
    assert waiting <= set(after["trained"]) | after["dropped"], (len(waiting), out[-3000:])
    versions = [s for s, _ in found["scalars"]["learner/loss"]]
    assert versions[-1] > before  # the resumed versions went on above every version published before
    assert json.loads((logdir / "checkpoints" / f"step-{STEPS:06d}" / "meta.json").read_text())["step"] == STEPS


def test_sigterm_checkpoints_and_exits_with_the_command_that_resume_continues(tmp_path):
    """A second job started in the running run's directory is refused first; then SIGTERM (as a
    scheduler sends it) stops the run, and --resume finishes it."""
    logdir = tmp_path / "run"
    proc = start(*RUN, "--logdir", str(logdir))
    try:
        while not (logdir / "config.json").exists():  # written once the job holds the directory
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        second = subprocess.Popen([sys.executable, "-m", "launch.async", "--resume", str(logdir)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for_version(proc, logdir, 2)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2 and f"another job is running in {logdir}" in err, err[-2000:]
    except BaseException:
        kill_job(proc)
        raise
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    stopped = re.search(rf"stopped at step (\d+) of {STEPS}: continue with  python -m launch\.async --resume (\S+)",
                        out)
    assert stopped and stopped.group(2) == str(logdir), out[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < STEPS
    assert os.path.isdir(logdir / "checkpoints" / f"step-{step:06d}")  # saved where it stopped: nothing lost
    out = finish(start("--resume", str(logdir), "--actors", "1"))
    found = audit(logdir)
    assert [s for s, _ in found["scalars"]["learner/loss"]] == list(range(1, STEPS + 1))  # no step lost or repeated
