"""Building real groups for replay tests (data, not stand-ins for our parts)."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from replay.wire import Group, Trajectory


def make_group(version: int = 0, size: int = 4, length: int = 40, rewards=None, seed: int = 0,
               actor: str = "actor-0") -> Group:
    rng = np.random.default_rng(seed)
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(size)]
    trajs = []
    for r in rewards:
        mask = (np.arange(length) % 4 == 3).astype(np.uint8)
        trajs.append(Trajectory(
            tokens=rng.integers(4, 100, length).astype(np.int32),
            logprobs=np.where(mask, -rng.random(length) * 3, 0).astype(np.float32),
            mask=mask, versions=np.full(length, version, np.int32),
            reward=float(r), turns=3, finish_reason="terminated"))
    return Group(uuid.uuid4().hex, f"seed={seed}", trajs, actor=actor)


def make_entry(**kwargs):
    """A group as the buffer stores it."""
    from replay.buffer import Entry
    from replay.wire import encode_group

    g = make_group(**kwargs)
    return Entry.of(g, encode_group(g))


KEY = os.urandom(32)
"""The run key of the replay processes that `start_replay` starts."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replay(port: int, log_dir, fsync: str = "interval", groups_per_step: int = 2,
                 learners: int = 1) -> subprocess.Popen:
    """A replay service process (`python -m replay.server`) on `port`, keeping its log in `log_dir`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay.server", "--groups-per-step", str(groups_per_step),
         "--learners", str(learners), "--max-staleness", "1000",
         "--replay.port", str(port), "--replay.log-dir", str(log_dir), "--replay.fsync", fsync],
        env={**os.environ, "TANDEM_KEY": KEY.hex()}, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "replay serving" in line, line
    return proc


class ReplayProcess:
    """A replay service process on one port and log directory, to kill and start again."""

    def __init__(self, log_dir, **kwargs) -> None:
        self.port, self.log_dir, self.kwargs = free_port(), log_dir, kwargs
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.proc = start_replay(self.port, log_dir, **kwargs)

    def pause(self) -> None:
        """SIGSTOP it and wait until it is stopped: from here on it reads nothing."""
        self.proc.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{self.proc.pid}/stat")
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)

    def restart(self) -> None:
        """SIGKILL it (if it runs), then start a new one."""
        self.stop()
        self.proc = start_replay(self.port, self.log_dir, **self.kwargs)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
