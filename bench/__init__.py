"""Benchmarks: figures measured against a baseline in the same run, ending with one JSON line.

Figures are printed to four significant digits (`sig`), so a short interval never reads as zero,
and a ratio divides by at least one tick of the clock (`ratio`), so it is always finite.
"""

import math
import statistics
import time

TICK = time.get_clock_info("perf_counter").resolution
"""The clock's resolution: no interval measured with time.perf_counter() is shorter than this."""


def sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits (0.000412 stays 0.000412; round(x, 3) would give 0.0)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def ratio(num: float, den: float, digits: int = 4) -> float:
    """num / den for two measured times (or rates), the denominator at least one clock tick."""
    return sig(num / max(den, TICK), digits)


def with_medians(figures: dict) -> dict:
    """`figures` with `<key>_median` added for every list of per-round ratios (a key holding "ratio")."""
    for key in [k for k in figures if "ratio" in k and isinstance(figures[k], list)]:
        figures[f"{key}_median"] = sig(statistics.median(figures[key]))
    return figures
