"""The main job against a Ray cluster that declares GPUs this machine does not have.

A head started with `ray start --head --num-gpus 4` (on loopback, its own temp dir) stands for a
GPU node. torch here is a CPU build, so a part that asks for a GPU is given one by Ray and cannot
use it: the job must stop at start with a message that says so, not train on the CPU, and a job
that asks for more GPUs than the cluster has must stop before it places anything.

Teardown never runs `ray stop` (it ends every Ray on the machine): it kills exactly the processes
whose command line holds this head's temp dir, and the head's session.
"""

import contextlib
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow  # whole processes of a job or a benchmark: `pytest -m slow`

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(temp_dir: Path, session: int) -> None:
    for _ in range(3):
        procs = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, OSError):
                if str(temp_dir) in " ".join(p.info["cmdline"] or ()) or os.getsid(p.pid) == session:
                    procs.append(p)
        procs = [p for p in procs if p.pid != os.getpid()]
        if not procs:
            return
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=5)


@pytest.fixture(scope="module")
def gpu_head():
    """(address, env) of a one-node Ray cluster declaring 4 GPUs and 4 CPUs."""
    temp_dir = Path(f"/tmp/tnd-gpu-{secrets.token_hex(3)}")
    temp_dir.mkdir()
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    ray = str(Path(sys.executable).parent / "ray")
    with open(temp_dir / "ray-start.log", "w") as log:
        head = subprocess.Popen([ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                                 "--num-cpus=4", "--num-gpus=4", "--include-dashboard=false",
                                 f"--temp-dir={temp_dir}", "--disable-usage-stats", "--block"],
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start:\n{(temp_dir / 'ray-start.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", env
    finally:
        _kill(temp_dir, head.pid)
        head.wait(timeout=10)
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


def job(gpu_head, tmp_path, *args, timeout=600) -> subprocess.CompletedProcess:
    address, env = gpu_head
    return subprocess.run([sys.executable, "-m", "launch.async", "--ray-address", address, "--model", "builtin:tiny",
                           "--steps", "2", "--learner.groups-per-step", "2", "--eval-episodes", "2",
                           "--logdir", str(tmp_path / "run"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_learner_given_a_gpu_that_torch_cannot_use_stops_the_job_at_start(gpu_head, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device: a part given a GPU can use it")
    run = job(gpu_head, tmp_path, "--actors", "1", "--learners", "1", "--learner.gpus", "1")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^error: a part could not start: RuntimeError: this part asked for --learner\.gpus 1 and Ray "
                     r"gave it GPU 0 on \S+, but torch sees no CUDA device there \(a CPU build of torch",
                     run.stderr, re.MULTILINE), run.stderr[-3000:]
    assert "eval v0" not in run.stdout and "step 1/" not in run.stdout  # nothing trained on the CPU instead


def test_actors_given_gpus_torch_cannot_use_stop_the_job_at_start(gpu_head, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device: a part given a GPU can use it")
    run = job(gpu_head, tmp_path, "--actors", "2", "--learners", "1", "--actor.gpus", "0.5")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    # an actor's constructor (the evaluation borrows an actor's engine: no part of its own)
    assert "this part asked for --actor.gpus 0.5 and Ray gave it GPU " in run.stderr, run.stderr[-3000:]
    assert "eval v0" not in run.stdout


def test_more_gpus_than_the_cluster_has_stop_the_job_before_anything_is_placed(gpu_head, tmp_path):
    run = job(gpu_head, tmp_path, "--actors", "4", "--learners", "1", "--actor.gpus", "1", "--learner.gpus", "1")
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert ("error: the parts ask for 5 GPUs (actors 4 × 1 + learner ranks 1 × 1); "
            "the Ray cluster has 4.") in run.stderr, run.stderr[-3000:]
    assert "placement (" not in run.stdout
