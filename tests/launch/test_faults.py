"""Parts of a real run (real Ray, real processes) SIGKILLed at a random moment, as a lost node, an
out-of-memory kill or a preempted machine would: the run reaches its step budget, versions only go
up, no group is trained twice, and every group replay acknowledged to an actor is trained on,
dropped as stale, or still buffered at the end. Kills share runs where their checks allow. (Parts
that die past their restarts, as the driver sees them: tests/launch/test_supervise.py.)

Two runs carry every kill: an actor, a learner rank, then SIGTERM and a resume; an actor, the
replay service, then the driver and a resume. A third kills a learner rank of a colocated run."""

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

STEPS = 9
CHECKPOINT_EVERY = 3
RUN = ["--actors", "2", "--learners", "2", "--steps", str(STEPS), "--learner.groups-per-step", "4",
       "--eval-episodes", "8", "--checkpoint-every", str(CHECKPOINT_EVERY), "--replay.keep-log"]


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


def kill_part(proc: subprocess.Popen, title: str, timeout: float = 120) -> None:
    """SIGKILL one of the run's processes whose title starts with `title` (e.g. "ray::LearnerPart"),
    waiting up to `timeout` s for one: a Ray worker takes its part's title only once the part is
    being built, which can come a moment after the driver's first lines."""
    deadline = time.time() + timeout
    while True:
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if " ".join(p.cmdline()).startswith(title):
                    found.append(p)
            except psutil.Error:
                continue
        if found:
            break
        assert proc.poll() is None, f"the run ended before a {title} process was there"
        assert time.time() < deadline, f"no {title} process within {timeout} s"
        time.sleep(0.2)
    random.choice(found).send_signal(signal.SIGKILL)


def kill_after(proc: subprocess.Popen, logdir: Path, versions: tuple[int, int], title: str) -> None:
    """SIGKILL a part (as kill_part) at a random moment after a random version in `versions`."""
    wait_for_version(proc, logdir, random.randint(*versions))
    time.sleep(random.uniform(0, 2))
    kill_part(proc, title)


def kill_job(proc: subprocess.Popen) -> str:
    """SIGKILL the driver, as a lost machine would, and wait for its parts to end (Ray's workers end
    with its raylet, which ends with the driver); any still there after a minute are killed. Ray's
    dashboard and runtime-env agents can outlive the raylet: they are killed once the rest is gone.
    Returns what the job printed that was not read yet."""
    parts, agents = [], []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            (agents if p.name().endswith("Agent") else parts).append(p)
        except psutil.NoSuchProcess:
            continue
    proc.kill()
    out, _ = proc.communicate(timeout=60)
    _, alive = psutil.wait_procs(parts, timeout=60)
    for p in alive + agents:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    return out


def finish(proc: subprocess.Popen, seen: str = "") -> str:
    out, _ = proc.communicate(timeout=900)
    out = seen + out
    assert proc.returncode == 0, out[-5000:]
    assert f"done: {STEPS} steps" in out, out[-3000:]
    return out


def dropped_counted(logdir: Path) -> float:
    """The stale drops counted in TensorBoard, over every replay process. Each job (a first run, a
    resume) writes its own events file and its replay process counts from 0; one restarted inside a
    job counts from 0 again. Read job by job: a resumed job that drops as many stale groups as the
    job before it counted shows the same value at its first step, and a series merged over the jobs
    would read that as nothing new."""
    total = 0.0
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        last = 0.0
        for _, value in read_scalars(str(path)).get("replay/dropped_stale", []):
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
        assert len(dropped) <= dropped_counted(logdir), "a drop not counted"
    return {"trained": len(log["trained"]), "dropped": len(dropped), "buffered": len(buffered), "scalars": scalars}


def wait_for_scalar(proc: subprocess.Popen, logdir: Path, tag: str, value: float, timeout: float = 600) -> None:
    """Until the job's TensorBoard files hold `tag` at `value` (the driver flushes them at every step)."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, f"the run ended before {tag} reached {value}: {proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, f"{tag} not at {value} within {timeout} s"
        if any(v == value for _, v in read_scalars(str(logdir)).get(tag, [])):
            return
        time.sleep(1)


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 600) -> str:
    """The job's output up to and including its first line holding `text`."""
    seen, deadline = [], time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return "".join(seen)
        assert time.time() < deadline, "".join(seen[-20:])
    raise AssertionError(f"the run ended before printing {text!r}: {''.join(seen)[-3000:]}")


def test_an_actor_and_a_learner_rank_killed_are_brought_back_then_sigterm_stops_the_run_and_resume_finishes_it(tmp_path):
    """A second job started in the running run's directory is refused; an actor, then a learner
    rank, is SIGKILLed at a random moment and brought back, and nothing is trained twice; then
    SIGTERM (as a scheduler sends it) checkpoints and stops the run, and --resume finishes it
    without losing or repeating a step."""
    logdir = tmp_path / "run"
    proc = start(*RUN, "--logdir", str(logdir))
    try:
        while not (logdir / "config.json").exists():  # written once the job holds the directory
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        second = subprocess.Popen([sys.executable, "-m", "launch.async", "--resume", str(logdir)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for_version(proc, logdir, random.randint(1, 2))
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2 and f"another job is running in {logdir}" in err, err[-2000:]
        time.sleep(random.uniform(0, 2))
        kill_part(proc, "ray::ActorPart")
        kill_after(proc, logdir, (3, 4), "ray::LearnerPart")
        wait_for_scalar(proc, logdir, "learner/restarts", 1.0)  # a step trained by the group brought back
    except BaseException:
        kill_job(proc)
        raise
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"actor-\d died .*restarting it \(1 of 3\)", out), out[-4000:]
    assert re.search(r"a learner rank died .*went back to its newest checkpoint \(1 of 2 restarts\)", out), \
        out[-4000:]
    stopped = re.search(rf"stopped at step (\d+) of {STEPS}: continue with  python -m launch\.async --resume (\S+)",
                        out)
    assert stopped and stopped.group(2) == str(logdir), out[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < STEPS
    assert os.path.isdir(logdir / "checkpoints" / f"step-{step:06d}")  # saved where it stopped: nothing lost
    first = read_scalars(str(logdir))
    assert first["actors/restarts"][-1][1] == 1.0 and first["learner/restarts"][-1][1] == 1.0
    finish(start("--resume", str(logdir), "--actors", "1"))
    found = audit(logdir)
    steps = [v for _, v in found["scalars"]["learner/step"]]
    assert steps[step - STEPS - 1:] == list(range(step, STEPS + 1)), steps  # no step lost or repeated by the resume


def test_an_actor_and_the_replay_service_killed_are_brought_back_then_a_killed_driver_leaves_a_run_that_resume_finishes(
        tmp_path):
    """The actor just after version 0 is evaluated (in its constructor or its loop, at random),
    then the replay service at a later version: each is restarted once and no step is lost. Then
    the driver is SIGKILLed, as a lost machine would be, and --resume finishes the run: every group
    acknowledged to an actor and not trained on is served or dropped as stale."""
    logdir = tmp_path / "run"
    proc = start(*RUN, "--logdir", str(logdir))
    try:
        seen = wait_for_line(proc, "eval v0")  # the actors are starting or generating
        time.sleep(random.uniform(0, 4))
        kill_part(proc, "ray::ActorPart")
        kill_after(proc, logdir, (2, 3), "ray::ReplayPart")
        wait_for_scalar(proc, logdir, "replay/restarts", 1.0)  # a step trained after the replay came back
        time.sleep(random.uniform(0, 2))
    except BaseException:
        kill_job(proc)
        raise
    out = seen + kill_job(proc)
    assert re.search(r"actor-\d died .*restarting it \(1 of 3\)", out), out[-4000:]
    assert re.search(r"the replay service died .*its log brings back every stored group \(1 of 3\)", out), out[-4000:]
    first = read_scalars(str(logdir))  # what the killed driver wrote: flushed at every step
    assert first["actors/restarts"][-1][1] == 1.0 and first["replay/restarts"][-1][1] == 1.0
    losses = [s for s, _ in first["learner/loss"]]
    assert losses == list(range(1, len(losses) + 1))  # every step trained while parts died
    before = published(logdir)
    at_kill = history(logdir / "replay-log")
    waiting = set(at_kill["stored"]) - at_kill["consumed"]  # acknowledged to actors, not trained on
    finish(start("--resume", str(logdir)))
    # Drops the killed replays counted after their last report are not in TensorBoard: not compared.
    found = audit(logdir, count_drops=False)
    after = history(logdir / "replay-log")
    # Served after the resume (oldest first), or dropped as too stale for the resumed versions.
    assert waiting <= set(after["trained"]) | after["dropped"], len(waiting)
    versions = [s for s, _ in found["scalars"]["learner/loss"]]
    assert versions[-1] > before  # the resumed versions went on above every version published before
    assert json.loads((logdir / "checkpoints" / f"step-{STEPS:06d}" / "meta.json").read_text())["step"] == STEPS


def test_a_learner_rank_killed_in_a_colocated_run_is_brought_back_and_every_step_stays_on_policy(tmp_path):
    """Colocated, each rank generates its share, then trains: a rank SIGKILLed at a random moment
    (generating or training) brings the group back from its newest checkpoint, and every step,
    before and after, is trained on groups its own version generated."""
    logdir = tmp_path / "run"
    proc = start(*RUN, "--colocate", "--logdir", str(logdir))
    try:
        kill_after(proc, logdir, (2, 4), "ray::LearnerPart")
    except BaseException:
        kill_job(proc)
        raise
    out = finish(proc)
    assert re.search(r"a learner rank died .*went back to its newest checkpoint \(1 of 2 restarts\)", out), \
        out[-4000:]
    found = audit(logdir)
    assert found["scalars"]["learner/restarts"][-1][1] == 1.0
    staleness = found["scalars"]["async/staleness_max"]
    assert staleness and all(v == 0.0 for _, v in staleness), staleness
    # The steps lost with the killed group were trained again. Scalars are written at policy
    # versions, and a group brought back goes on above every version published before the kill
    # (e.g. steps 1-4 at versions 1-4, then 4-9 at 6-11): the steps are read from learner/step. A
    # rank killed right after a checkpoint is written takes that step's report with it: the group
    # comes back after the step, which is not trained twice, so its scalars alone may be missing.
    missing = set(range(1, STEPS + 1)) - {int(v) for _, v in found["scalars"]["learner/step"]}
    assert len(missing) <= 1 and all(s % CHECKPOINT_EVERY == 0 for s in missing), sorted(missing)
