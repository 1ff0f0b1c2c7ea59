"""The launcher: config, placement on Ray, monitoring, evaluation."""
