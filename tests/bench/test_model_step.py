"""`python -m bench.model_step` run as a user runs it, on a tiny shape: it ends with its JSON line."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole processes of a job or a benchmark: `pytest -m slow`

ROOT = Path(__file__).resolve().parents[2]


def test_the_model_step_bench_runs_both_variants_and_ends_with_one_json_line():
    cmd = [sys.executable, "-m", "bench.model_step", "--layers", "2", "--hidden", "64", "--intermediate", "128",
           "--heads", "4", "--kv-heads", "2", "--vocab", "3000", "--rows", "3", "--tokens", "40",
           "--logit-chunk", "16", "--threads", "1", "--activation-checkpointing"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("peak_rss_mb_chunked", "peak_rss_mb_unchunked"):
        assert out[key] > 0, key
    for key in ("step_s_chunked", "step_s_unchunked", "peak_ratio", "step_ratio"):  # a time may be under a tick
        assert 0 <= out[key] < math.inf, key
    assert (out["rows"], out["tokens"], out["layers"], out["vocab"], out["logit_chunk"]) == (3, 40, 2, 3000, 16)
    assert out["activation_checkpointing"] is True
    # the same step both ways: 3 × 39 predicted positions in 8 chunks of 16, or in one piece
    assert abs(out["loss_chunked"] - out["loss_unchunked"]) <= 1e-5 * max(1.0, abs(out["loss_unchunked"]))
    assert out["loss_unchunked"] != 0.0


def test_the_model_step_bench_refuses_a_batch_that_would_not_train():
    proc = subprocess.run([sys.executable, "-m", "bench.model_step", "--rows", "1"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 2 and "--rows must be at least 2" in proc.stdout
