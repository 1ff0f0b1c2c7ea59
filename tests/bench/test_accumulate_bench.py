"""bench.accumulate times the real 2-rank learner step with a learner option off and on."""

import json

import pytest

from bench.accumulate import OPTIONS, main, parse
from learner.config import LearnerConfig


@pytest.mark.slow
def test_the_bench_times_fused_lora_off_and_on_run_as_a_user_would(tiny_vlm, capsys):
    assert main(["--option", "fused-lora", "--model", tiny_vlm, "--groups", "2", "--group-size", "2",
                 "--turns", "2", "--warmup", "0", "--steps", "1", "--rounds", "1"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["option"] == "fused-lora"
    assert figures["step_s_off"] > 0 and figures["step_s_on"] > 0 and figures["step_ratio"][0] > 0
    # the same update either way: the losses agree up to float summation order
    assert figures["loss_on"] == pytest.approx(figures["loss_off"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("argv, named", [(["--option", "fp8"], "--option"), (["--groups", "3"], "--groups")])
def test_bad_arguments_are_refused_with_a_message(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse(argv)
    assert named in capsys.readouterr().err


def test_each_option_sets_a_learner_field_both_ways():
    """Each --option's two variants are LearnerConfigs a run would accept, and differ; with
    `--option bf16` the learner computes in float32 off and bfloat16 on."""
    import torch

    from learner.model import resolve_dtype

    assert parse(["--option", "bf16"]).option == "bf16"
    for field, values in OPTIONS.values():
        configs = [LearnerConfig(**{field: values[v]}) for v in ("off", "on")]
        assert getattr(configs[0], field) != getattr(configs[1], field)
    field, values = OPTIONS["bf16"]
    assert field == "dtype"
    dtypes = [resolve_dtype(LearnerConfig(dtype=values[v]).dtype, torch.device("cpu")) for v in ("off", "on")]
    assert dtypes == [torch.float32, torch.bfloat16]
