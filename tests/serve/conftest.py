"""A real `python -m launch.tinker` process on a free loopback port, and the real `tinker` SDK
talking to it over HTTP. The SDK is the `tinker` extra (in the test extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("tinker", reason="the tinker SDK is the `tinker` extra (pip install -e '.[tinker]')")

os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK would otherwise post telemetry to the service
KEY = "tml-tandem-test-key"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    url: str
    logdir: Path
    proc: subprocess.Popen
    log: Path

    def client(self, **kw):
        import tinker

        return tinker.ServiceClient(base_url=self.url, api_key=KEY, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_service(model: str, logdir: Path, *flags: str, key: str = KEY) -> Served:
    """Start the service and wait for its `listening on` line (the socket then accepts)."""
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"service-{time.monotonic_ns()}.log"
    env = {**os.environ, "TINKER_API_KEY": key, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.tinker", "--port", "0", "--model", model,
                             "--logdir", str(logdir), "--threads", "1", *flags],
                            stdout=subprocess.PIPE, stderr=out, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        if "listening on " in line:
            return Served(line.split("listening on ")[1].strip(), logdir, proc, log)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError(f"the service did not start: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """One service for the module, with forward_backward chunks of 2 datums, 2 s polls, 1 MiB bodies."""
    s = start_service(tiny_model, tmp_path_factory.mktemp("tinker"), "--chunk-datums", "2", "--poll-s", "2",
                      "--max-body-mb", "1")
    yield s
    s.stop()
