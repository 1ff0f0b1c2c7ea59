"""`python -m bench.weights` run as a user runs it, on a small adapter: subscriber processes on this
host read it from shared memory, the socket path's take the chunks, and it ends with its JSON line."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole processes of a job or a benchmark: `pytest -m slow`

ROOT = Path(__file__).resolve().parents[2]


def test_the_weights_bench_times_every_path_and_ends_with_one_json_line():
    cmd = [sys.executable, "-m", "bench.weights", "--subscribers", "2", "--layers", "2", "--hidden", "256",
           "--intermediate", "512", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--rank", "8",
           "--chunk-mib", "1", "--repeats", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["subscribers"], out["tensors"], out["signed"]) == (2, 2 * 7 * 2, True)
    for key in ("channel_s", "publish_s", "socket_s", "bare_s", "bare_blake3_s"):  # a time may be under a tick
        assert 0 <= out[key] < math.inf, key
    for key in ("ratio", "ratio_socket", "ratio_floor"):
        assert 0 <= out[key] < math.inf, key
    # processes beside the publisher read shared memory; the socket path's never do
    assert out["subscribers_reading_shm"] == 2 and out["subscribers_reading_shm_socket_path"] == 0
