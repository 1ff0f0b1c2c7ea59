"""The CPU-checkable parts of bench/gpu_vllm.py (the vLLM checks of `python -m bench.gpu_check`;
the checks themselves run on a GPU: tests/bench/test_gpu_check.py)."""

import pytest

from bench import gpu_check, gpu_vllm
from launch.colocate import greedy_equal


def test_greedy_tokens_that_change_across_a_sleep_stop_with_a_message():
    """What a colocated rank checks once before its first generation with a sleeping engine
    (launch/colocate.py), and the GPU check after every wake."""
    greedy_equal([[5, 6, 7], [8]], [[5, 6, 7], [8]])
    with pytest.raises(RuntimeError, match=r"greedy tokens of prompt 1 changed across a sleep and a wake .*"
                                           r"vLLM issue 53888"):
        greedy_equal([[5, 6, 7], [8, 9]], [[5, 6, 7], [8, 2]])
    with pytest.raises(RuntimeError, match="2 completions before the sleep, 1 after"):
        greedy_equal([[5], [6]], [[5]])


def test_the_vllm_checks_are_chosen_by_name_and_skipped_without_cuda():
    assert gpu_check.parse(["--checks", "colocated,parity_vllm,two_engines"]).checks.split(",") == list(
        gpu_check.VLLM_CHECKS)
    assert set(gpu_check.VLLM_CHECKS) <= set(gpu_check.CHECKS)
    assert gpu_vllm.skipped("cpu") == {"skipped": "needs CUDA (vLLM's sleep mode and GPU memory)"}
    assert gpu_vllm.skipped("cuda") is None
