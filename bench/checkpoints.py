"""`python -m bench.checkpoints`: what checkpoints and the replay log cost the default run.

Runs the default job (`python -m launch.async`, every setting at its default) for `--steps`
steps three ways, in turn, `--rounds` times, on the same cores:
  off          --checkpoint-every 0 (no checkpoints; the replay log is off with them)
  checkpoints  --checkpoint-every 10 --replay.no-log (checkpoints only)
  both         the defaults: checkpoints every 10 steps and the replay log in the run directory
and measures the learners' wall time per step from TensorBoard's event times, from step `--skip`
(past start-up) to the last. Prints a table and, last, one JSON line: step_s_off,
step_s_checkpoints, step_s_both, overhead_checkpoints and overhead_both (time per step against
off: 1.0 is free), overhead_log (both against checkpoints: the log's own cost), checkpoint_s (mean time of one checkpoint, as the learners report it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import tyro

from bench import ratio, sig

VARIANTS = {"off": ["--checkpoint-every", "0"],
            "checkpoints": ["--checkpoint-every", "10", "--replay.no-log"],
            "both": []}


@dataclass
class Args:
    steps: int = 40
    """Steps of each run."""
    skip: int = 5
    """Steps left out of the timing (start-up, the first evaluation)."""
    rounds: int = 2
    """Runs of each variant (interleaved: the machine's noise falls on all three alike)."""


def step_times(logdir: str, skip: int) -> tuple[float, list[float]]:
    """(seconds per step from step `skip` to the last, each checkpoint's reported seconds)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    steps = sorted((e.value, e.wall_time) for e in acc.Scalars("learner/step"))
    (s0, t0), (s1, t1) = next(x for x in steps if x[0] >= skip), steps[-1]
    saves = [e.value for e in acc.Scalars("perf/checkpoint_s")] if "perf/checkpoint_s" in acc.Tags()["scalars"] else []
    return (t1 - t0) / (s1 - s0), saves


def main(args: Args) -> dict:
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    saves: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ckpt-") as tmp:
        for r in range(args.rounds):
            order = list(VARIANTS)[r % 3:] + list(VARIANTS)[:r % 3]
            for name in order:
                logdir = os.path.join(tmp, f"{name}-{r}")
                cmd = [sys.executable, "-m", "launch.async", "--steps", str(args.steps), "--logdir", logdir,
                       *VARIANTS[name]]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
                per_step, s = step_times(logdir, args.skip)
                results[name].append(per_step)
                saves += s
                print(f"round {r + 1} {name:<12} {per_step:.3f} s/step", flush=True)
    mean = {k: sum(v) / len(v) for k, v in results.items()}
    out = {"step_s_off": sig(mean["off"]), "step_s_checkpoints": sig(mean["checkpoints"]),
           "step_s_both": sig(mean["both"]),
           "overhead_checkpoints": ratio(mean["checkpoints"], mean["off"]),
           "overhead_both": ratio(mean["both"], mean["off"]),
           "overhead_log": ratio(mean["both"], mean["checkpoints"]),
           "checkpoint_s": sig(sum(saves) / len(saves)) if saves else None}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
