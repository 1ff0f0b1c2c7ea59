"""bench/tinker.py runs end to end: the SDK's step against the trainer's, one JSON line."""

import pytest

pytest.importorskip("tinker")


@pytest.mark.slow
def test_the_tinker_bench_runs(tiny_model, tmp_path, capsys):
    from bench.tinker import main

    result = main(["--steps", "2", "--datums", "2", "--tokens", "8", "--model", tiny_model,
                   "--logdir", str(tmp_path / "run")])
    assert result["sdk_step_s"] > 0 and result["direct_step_s"] > 0 and result["ratio"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"sdk_step_s"')
