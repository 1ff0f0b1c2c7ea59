"""`python -m bench.modes`: asynchronous against colocated training, on the same cores.

The main job runs twice on the maze with the same seed and settings, but the mode: async
(`--actors A --learners L`: actor processes generate while the learners train) and colocated
(`--colocate --learners L`: each learner rank generates its share of the batch with its own
model, then trains on it; no actor processes). Each run goes until its maze-64 evaluation
(greedy, every `--eval-every` steps, as the job logs it) reaches `--target`, or until
`--max-minutes`; it is then stopped with SIGTERM, as a scheduler would, and its figures read
from its TensorBoard events:

- time to target: wall time from the job's start (warm start included, the same in both
  modes) to the first evaluation at or above the target (None if the run never got there);
- trajectories per second: trajectories replay received, over the time from the first
  evaluation (version 0, when training starts) to the last step;
- peak RSS: the most resident memory the job's processes (the driver, Ray, every part) held
  together, sampled every second; and peak PSS, the same with each shared page counted once
  (RSS counts it in every process that maps it), sampled every 15 s (it costs the kernel a
  walk of every mapping).

Ends with one JSON line: traj_per_s_async, traj_per_s_colocated, time_to_target_async_s,
time_to_target_colocated_s, rss_async_mb, rss_colocated_mb, and speedup = colocated time to
target / async time to target (above 1: async got there faster).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tyro


@dataclass
class Args:
    actors: int = 6
    """Actor processes of the async run (the job's default)."""
    learners: int = 2
    """Learner ranks of both runs (the job's default)."""
    target: float = 0.9
    """maze-64 greedy success that ends a run."""
    max_minutes: float = 45.0
    """Wall-clock limit of each run (a run that has not reached the target by then reports None)."""
    steps: int = 250
    """Step budget of each run (the job's default)."""
    seed: int = 0
    """--seed of both runs."""
    extra: tuple[str, ...] = ()
    """More arguments for both runs (e.g. --extra --eval-every 5)."""


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (Ray's raylet, GCS and workers are the driver's)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _tree_rss(tree: list[int]) -> int:
    """RSS in bytes of the processes `tree`: each page a process maps counts once per process
    that maps it (the model a forked worker shares with its parent, a shared-memory file every
    reader maps). Cheap (/proc/PID/statm), so it is sampled often."""
    page, rss = os.sysconf("SC_PAGE_SIZE"), 0
    for p in tree:
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return rss


def _tree_pss(tree: list[int]) -> int:
    """PSS in bytes of the processes `tree`: each shared page split among the processes that map
    it. Costly (the kernel walks every mapping, holding each process's memory lock), so it is
    sampled rarely, not to slow the run it measures."""
    pss = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss += sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, IndexError, ValueError):
            continue
    return pss


def _events(logdir: str) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def run(mode: str, args: Args, root: str) -> dict:
    """One job in `mode` ("async" or "colocated") until the target or the time limit."""
    logdir = os.path.join(root, mode)
    cmd = [sys.executable, "-m", "launch.async", "--learners", str(args.learners), "--steps", str(args.steps),
           "--seed", str(args.seed), "--logdir", logdir, *args.extra]
    cmd += ["--colocate"] if mode == "colocated" else ["--actors", str(args.actors)]
    print(f"{mode}: {' '.join(cmd[1:])}", flush=True)
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    peak, peak_pss, reached, last_read = 0, 0, None, 0.0
    try:
        while proc.poll() is None and time.time() - started < 60 * args.max_minutes:
            tree = _descendants(proc.pid)
            peak = max(peak, _tree_rss(tree))
            time.sleep(1.0)
            if time.time() - last_read > 15:
                last_read = time.time()
                peak_pss = max(peak_pss, _tree_pss(tree))
                evals = _events(logdir).get("eval/success_rate", []) if os.path.isdir(logdir) else []
                hit = [e for e in evals if e.value >= args.target]
                if hit:
                    reached = hit[0].wall_time - started
                    break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the job checkpoints and exits
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = proc.stdout.read()
    events = _events(logdir)
    evals, steps = events.get("eval/success_rate", []), events.get("learner/loss", [])
    if not evals or not steps:
        raise SystemExit(f"error: the {mode} run logged no evaluation or step; its output:\n{out[-3000:]}")
    groups = events["replay/groups_in"][-1].value
    group_size = json.load(open(os.path.join(logdir, "config.json")))["actor"]["group_size"]
    span = steps[-1].wall_time - evals[0].wall_time
    result = {"time_to_target_s": None if reached is None else round(reached, 1),
              "traj_per_s": round(groups * group_size / span, 2), "rss_mb": round(peak / 2**20),
              "pss_mb": round(peak_pss / 2**20),
              "steps": steps[-1].step, "best_eval": max(e.value for e in evals)}

    def mean(tag: str):
        values = [e.value for e in events.get(tag, [])]
        return round(sum(values) / len(values), 3) if values else None

    # where a step's time goes: training, waiting for the batch, generating (colocated)
    result.update(train_s=mean("perf/learner_train_s"), idle=mean("perf/learner_idle_fraction"),
                  generate_share=mean("colocate/generate_share"))
    print(f"{mode}: {result}", flush=True)
    return result


def main(args: Args) -> dict:
    with tempfile.TemporaryDirectory(prefix="tandem-modes-") as root:
        a = run("async", args, root)
        c = run("colocated", args, root)
    both = a["time_to_target_s"] is not None and c["time_to_target_s"] is not None
    result = {"traj_per_s_async": a["traj_per_s"], "traj_per_s_colocated": c["traj_per_s"],
              "time_to_target_async_s": a["time_to_target_s"], "time_to_target_colocated_s": c["time_to_target_s"],
              "rss_async_mb": a["rss_mb"], "rss_colocated_mb": c["rss_mb"],
              "pss_async_mb": a["pss_mb"], "pss_colocated_mb": c["pss_mb"],
              "speedup": round(c["time_to_target_s"] / a["time_to_target_s"], 2) if both else None,
              "target": args.target, "steps_async": a["steps"], "steps_colocated": c["steps"],
              "best_eval_async": a["best_eval"], "best_eval_colocated": c["best_eval"],
              "train_s_async": a["train_s"], "train_s_colocated": c["train_s"], "idle_async": a["idle"],
              "generate_share_colocated": c["generate_share"], "cores": os.cpu_count()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
