"""`python -m bench.prefill`: what prefilling the episodes that join a running batch apart
(actors/torch_engine.py, `_feed`) buys the torch engine's actors on the CPU, against feeding
their prompts with the running episodes' observations in one forward.

Each round, one actor with the torch engine plays --groups timed groups (after --warmup) of each
environment of --envs, groups of --group-size (the image maze's 16), with its warm-start policy
(bench/engines.py's `rate`: trajectories a second, its default groups in flight, so new groups
join running ones as in a run), once each way, the two alternating so that the machine's drift
falls on both. Both play the same seeded episodes.

Run it alone, one torch thread. --model takes another model for every environment (tests: a tiny
one); by default each environment's warm start, built on first use. Ends with one JSON line: each
rate both ways, the per-round ratios (above 1: prefilling apart is faster) and their medians.
"""

from __future__ import annotations

import argparse
import json

from bench import ratio, with_medians

WAYS = {"together": False, "apart": True}
"""The two ways measured: name → the torch engine's `prefill_apart`."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds; each measures both ways")
    p.add_argument("--groups", type=int, default=16, help="timed groups per measurement")
    p.add_argument("--warmup", type=int, default=4, help="untimed groups first")
    p.add_argument("--group-size", type=int, default=16, help="episodes a group (the image maze's 16)")
    p.add_argument("--envs", default="image-maze,maze", help="environments the actor plays")
    p.add_argument("--model", default=None, help="one model for every environment (default: the warm starts)")
    args = p.parse_args(argv)
    if min(args.rounds, args.groups, args.group_size, args.warmup) < 1:
        p.error("--rounds, --groups, --group-size and --warmup must be at least 1")
    return args


def measure(args: argparse.Namespace) -> dict:
    import torch

    from bench.engines import rates_each_way
    from launch.warmstart import ensure_warmstart

    torch.set_num_threads(1)
    out: dict = {}
    for r in range(args.rounds):
        for env in [e for e in args.envs.split(",") if e]:
            path = args.model or ensure_warmstart(log=print, env=env)
            rates = rates_each_way(out, r, env, path, args, "prefill_apart", WAYS)
            out.setdefault(f"ratio_{env}", []).append(ratio(rates["apart"], rates["together"]))
            print(f"round {r} {env}: {rates['together']:.2f} trajectories/s prefilled together, "
                  f"{rates['apart']:.2f} apart", flush=True)
    return with_medians(out)


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(measure(parse(argv))))


if __name__ == "__main__":
    main()
