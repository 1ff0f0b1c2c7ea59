"""bench.prefill measures both ways, each round, on every environment it is given."""

import pytest

from bench.prefill import measure, parse


def test_the_bench_reports_both_ways_and_their_ratio_run_as_a_user_would(tiny_vlm):
    figures = measure(parse(["--model", tiny_vlm, "--rounds", "1", "--groups", "1", "--warmup", "1",
                             "--group-size", "2", "--envs", "image-maze"]))
    for way in ("together", "apart"):
        assert len(figures[f"traj_per_s_image-maze_{way}"]) == 1
        assert figures[f"traj_per_s_image-maze_{way}"][0] > 0
    assert len(figures["ratio_image-maze"]) == 1 and figures["ratio_image-maze_median"] > 0


@pytest.mark.parametrize("argv, named", [(["--groups", "0"], "--groups"), (["--rounds", "0"], "--rounds")])
def test_bad_arguments_are_refused_with_a_message(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse(argv)
    assert named in capsys.readouterr().err
