"""bench.kv_cache measures both caches, each round, on every environment it is given."""

import pytest

from bench.kv_cache import measure, parse


def test_the_bench_reports_both_caches_and_their_ratio_run_as_a_user_would(tiny_vlm):
    figures = measure(parse(["--model", tiny_vlm, "--rounds", "1", "--groups", "1", "--warmup", "1",
                             "--group-size", "2", "--envs", "image-maze", "--contexts", "40", "--rows", "2",
                             "--new", "3"]))
    for cache in ("dynamic", "growing"):
        assert len(figures[f"traj_per_s_image-maze_{cache}"]) == 1
        assert figures[f"traj_per_s_image-maze_{cache}"][0] > 0
        assert figures[f"decode_s_40_{cache}"][0] > 0
    assert figures["ratio_image-maze_median"] > 0 and figures["ratio_decode_40_median"] > 0


@pytest.mark.parametrize("argv, named", [(["--groups", "0"], "--groups"), (["--contexts", "1k"], "--contexts"),
                                         (["--contexts", "0"], "--contexts")])
def test_bad_arguments_are_refused_with_a_message(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse(argv)
    assert named in capsys.readouterr().err
