"""The driver's TensorBoard board, read as a user's TensorBoard reads it."""

import subprocess
import sys

from launch.plot import read_scalars

LOG_THEN_DIE = """
import os, signal, sys
from launch.monitor import Board
board = Board(sys.argv[1], steps=3)
board.scalars(1, {"learner/loss": 0.5, "learner/step": 1.0})
board.scalars(2, {"learner/loss": 0.25, "learner/step": 2.0})
board.eval(2, {"success_rate": 0.75, "turns_mean": 4.0})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_driver_killed_mid_run_leaves_every_step_it_logged_on_disk(tmp_path):
    """A driver SIGKILLed (a lost machine) never closes its board: each step is flushed as logged."""
    run = subprocess.run([sys.executable, "-c", LOG_THEN_DIE, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == -9, run.stderr[-2000:]
    assert "eval v2: success 75.0%" in run.stdout
    scalars = read_scalars(str(tmp_path))
    assert scalars["learner/loss"] == [(1, 0.5), (2, 0.25)]
    assert scalars["eval/success_rate"] == [(2, 0.75)]
