"""bench.attention measures both attentions, each round, for the actor and the learner."""

from bench.attention import measure, parse
from policy.attention import GQA_SDPA


def test_the_bench_reports_both_attentions_and_their_ratios_run_as_a_user_would(tiny_vlm):
    args = parse(["--model", tiny_vlm, "--rounds", "1", "--groups", "1", "--warmup", "1", "--group-size", "2",
                  "--envs", "image-maze", "--rows", "2", "--tokens", "16", "--steps", "1"])
    figures = measure(args)
    for attention in ("sdpa", GQA_SDPA):
        assert len(figures[f"traj_per_s_image-maze_{attention}"]) == 1
        assert figures[f"traj_per_s_image-maze_{attention}"][0] > 0
        assert figures[f"learner_pass_s_{attention}"][0] > 0
    assert figures["actor_ratio_image-maze_median"] > 0 and figures["learner_ratio_median"] > 0


def test_bad_arguments_are_refused_with_a_message(capsys):
    import pytest

    with pytest.raises(SystemExit):
        parse(["--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err
