"""`python -m bench.gpu_check` as a user runs it: at once without a GPU, on tiny shapes on the CPU
(the same code path, gloo instead of NCCL), and in full where there is a GPU."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole processes of a job or a benchmark: `pytest -m slow`

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, timeout: int) -> tuple[int, str, dict]:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    last = proc.stdout.strip().splitlines()[-1]
    return proc.returncode, proc.stdout, json.loads(last) if last.startswith("{") else {}


def test_without_a_gpu_it_says_so_and_exits_at_once():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, result = _run(timeout=60)
    assert code == 0 and "no CUDA device" in out
    assert result["gpu"] is False and "step_0.5b" not in result


def test_the_checks_run_on_tiny_shapes_on_the_cpu():
    code, out, result = _run("--device", "cpu", "--tiny", "--prompts", "2", "--steps", "1", timeout=600)
    assert code == 0, out[-3000:]
    assert result["ok"] and result["tiny"] and not result["gpu"]
    for check in ("step_0.5b", "8b", "8b_ac"):
        assert 0 <= result[check]["step_s"] < math.inf and result[check]["params_m"] > 0, check
        assert result[check]["peak_gb"] is None  # no CUDA allocator to ask on the CPU
    # the same step with and without activation checkpointing: the same loss
    assert result["8b"]["loss"] == pytest.approx(result["8b_ac"]["loss"], rel=1e-4)
    assert result["8b"]["loss"] != 0.0
    for check in ("colocated", "parity_vllm", "two_engines"):  # vLLM's sleep mode and GPU memory: CUDA only
        assert result[check] == {"skipped": "needs CUDA (vLLM's sleep mode and GPU memory)"}, check
    image = result["image"]  # the engine's image episodes score as sampled, grey pictures do not; a step trains
    assert image["images"] > 0 and image["tokens"] > 0 and image["max_abs"] < 1e-4 and image["grey_max_abs"] > 1e-3
    assert image["adapter_changed"] and math.isfinite(image["loss"])
    parity = result["parity"]
    assert parity["tokens"] > 0 and parity["torch_fp32_max_abs"] < 1e-3
    assert 0 <= parity["torch_bf16_kl"] < 0.1 and parity["torch_bf16_max_abs"] < 1.0


def test_an_unknown_check_is_refused():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--checks", "8b,70b"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown checks ['70b']" in proc.stdout


@pytest.mark.gpu
def test_the_gpu_check_passes_on_a_gpu():
    code, out, result = _run(timeout=600)
    assert code == 0, out[-3000:]
    assert result["gpu"] and result["ok"]
    step = result["step_0.5b"]
    assert step["step_s"] > 0 and 0 < step["peak_gb"] < 40 and 400 < step["params_m"] < 600
    plain, ac = result["8b"], result["8b_ac"]
    assert 7000 < plain["params_m"] < 9000
    assert 14 < plain["setup_gb"] < 20  # bf16 base weights (15.3 GiB) and fp32 LoRA: no fp32 copy of the base
    assert ac["peak_gb"] < plain["peak_gb"]  # activation checkpointing saves memory
    assert result["parity"]["torch_fp32_max_abs"] < 1e-2 and result["parity"]["torch_bf16_kl"] < 0.05
    image = result["image"]  # the image path in bf16 on the GPU
    assert image["kl"] < 0.05 and image["grey_max_abs"] > image["max_abs"] and image["adapter_changed"]
    if importlib.util.find_spec("vllm") is None:
        assert result["colocated"] == {"skipped": "vLLM is not installed: pip install -e '.[vllm]'"}
        return
    colocated = result["colocated"]  # three wakes beside a training rank, greedy tokens equal across sleeps
    assert len(colocated["cycles"]) == 3 and colocated["greedy_equal_across_sleeps"]
    assert all(c["released_at_sleep_gb"] > 0 for c in colocated["cycles"])
    assert result["parity_vllm"]["tokens"] > 0 and result["parity_vllm"]["kl"] < 0.05
    assert result["two_engines"]["tokens"][0] > 0 and result["two_engines"]["tokens"][1] > 0
