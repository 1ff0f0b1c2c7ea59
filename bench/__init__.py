"""Benchmarks: figures measured against a baseline in the same run, ending with one JSON line."""
