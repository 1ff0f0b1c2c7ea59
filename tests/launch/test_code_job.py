"""`python -m launch.async --env code --steps 2` (one actor, one learner): the whole job with sandboxed coding episodes
(real Ray, actors running bash in bubblewrap, learners training on the trajectories). The
untrained tiny policy earns about nothing; the point is that the path runs and leaves nothing."""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from envs.sandbox_watch import sandboxed_pids
from launch.config import Config


@pytest.mark.slow
def test_code_job_runs_end_to_end(tmp_path):
    logdir = tmp_path / "run"
    root = Path(tempfile.mkdtemp(prefix="tandem-job-"))  # reachable by the sandbox's uid
    root.chmod(0o711)
    try:
        # One actor and one learner, small groups: the whole path (Ray, the sandboxed episodes, the
        # replay, a learner step, the evaluation, the cleanup) in minutes on 2 cores.
        run = subprocess.run([sys.executable, "-m", "launch.async", "--env", "code", "--steps", "2",
                              "--actors", "1", "--learners", "1", "--learner.groups-per-step", "1",
                              "--actor.group-size", "2", "--actor.groups-in-flight", "1",
                              "--eval-episodes", "2", "--code.sandbox-root", str(root), "--logdir", str(logdir)],
                             capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "done: 2 steps" in run.stdout
        assert sandboxed_pids(root) == []
        # nothing of the job is left in the sandbox root: no episode's folder, no sandbox's /etc
        # (read before the config below, whose check of the sandbox makes one in this process)
        assert [p.name for p in root.iterdir()] == []
        saved = Config.from_json((logdir / "config.json").read_text())
        assert (saved.env, saved.actor.max_new_tokens, saved.actor.max_tokens) == ("code", 256, 2048)
    finally:
        shutil.rmtree(root)


def test_limits_that_do_not_fit_the_actors_time_limit_are_refused():
    run = subprocess.run([sys.executable, "-m", "launch.async", "--env", "code", "--code.grade-s", "40"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--actor.env-timeout-s" in run.stderr
