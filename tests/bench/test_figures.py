"""The benches' figures: a short interval never prints as zero, and a ratio is always finite."""

import math

from bench import TICK, ratio, sig, with_medians


def test_a_figure_keeps_four_significant_digits_however_small():
    assert sig(0.000412345) == 0.0004123  # round(x, 3) printed this as 0.0
    assert sig(1234.5678) == 1235.0 and sig(0.1) == 0.1 and sig(-0.0012345) == -0.001234
    assert sig(0.0) == 0.0 and math.isnan(sig(math.nan)) and sig(math.inf) == math.inf


def test_a_ratio_divides_by_at_least_one_tick_of_the_clock():
    assert ratio(3.0, 1.5) == 2.0
    assert ratio(1e-6, 0.0) == sig(1e-6 / TICK)  # an interval shorter than the clock can tell
    assert math.isfinite(ratio(1.0, 0.0)) and ratio(0.0, 0.0) == 0.0


def test_every_list_of_ratios_gets_its_median_and_nothing_else_does():
    figures = with_medians({"ratio_maze": [1.0, 3.0, 2.0], "actor_ratio": [0.5], "rate": [1.0, 2.0], "ratio_note": 1.5})
    assert figures["ratio_maze_median"] == 2.0 and figures["actor_ratio_median"] == 0.5
    assert "rate_median" not in figures and "ratio_note_median" not in figures
