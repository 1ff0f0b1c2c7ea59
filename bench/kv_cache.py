"""`python -m bench.kv_cache`: what appending into kept room (actors/kv_cache.py) buys the torch
engine's actors on the CPU, against transformers' DynamicCache, which concatenates.

Each round, one actor with the torch engine plays --groups timed groups (after --warmup) of each
environment of --envs, groups of --group-size (the image maze's 16), with its warm-start policy
(bench/engines.py's `rate`: trajectories a second), once on each cache, the two alternating so
that the machine's drift falls on both. Both play the same seeded episodes (the caches hold the
same numbers). Then, for each --context, --rows rows of that many prompt tokens decode --new
tokens each with their prompt's keys and values kept (an agent's long context: a concatenating
cache copies the whole context at every step), seconds of the decoding alone.

Run it alone, one torch thread. --model takes another model for every environment (tests: a tiny
one); by default each environment's warm start (the text maze's for decoding), built on first
use. Ends with one JSON line: each rate and time on both caches, the per-round ratios (above 1:
the growing cache is faster) and their medians.
"""

from __future__ import annotations

import argparse
import json

from bench import ratio, sig, with_medians

CACHES = {"dynamic": False, "growing": True}
"""The caches measured: name → the torch engine's `growing_kv`."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds; each measures both caches")
    p.add_argument("--groups", type=int, default=10, help="timed groups per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed groups first")
    p.add_argument("--group-size", type=int, default=16, help="episodes a group (the image maze's 16)")
    p.add_argument("--envs", default="image-maze,maze", help="environments the actor plays")
    p.add_argument("--contexts", default="500,2000,8000", help="prompt lengths of the decoding measurement")
    p.add_argument("--rows", type=int, default=8, help="rows of the decoding measurement")
    p.add_argument("--new", type=int, default=128, help="tokens each row decodes")
    p.add_argument("--model", default=None, help="one model for every environment (default: the warm starts)")
    args = p.parse_args(argv)
    if min(args.rounds, args.groups, args.group_size, args.warmup, args.rows, args.new) < 1:
        p.error("--rounds, --groups, --group-size, --warmup, --rows and --new must be at least 1")
    try:
        args.contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        p.error(f"--contexts takes token counts separated by commas, not {args.contexts!r}")
    if any(c < 1 for c in args.contexts):
        p.error("--contexts must be at least 1 token each")
    return args


def decode_s(model_path: str, growing: bool, rows: int, context: int, new: int) -> float:
    """Seconds the torch engine takes to decode `new` tokens in each of `rows` rows after a
    prompt of `context` tokens already in its cache (seeded, never stopping)."""
    import time

    from actors.engine import SamplingParams
    from actors.torch_engine import TorchEngine
    from launch.config import Config

    engine = TorchEngine(model_path, Config().learner.lora, seed=0, growing_kv=growing)
    try:
        vocab = engine.model.get_base_model().config.get_text_config().vocab_size
        sessions, seeds = list(range(rows)), list(range(rows))
        special = set(engine.scheme.special_ids) if engine.scheme is not None else set()  # no image tokens
        allowed = [t for t in range(3, vocab) if t not in special]
        prompts = [[allowed[(7 * i + 13 * j) % len(allowed)] for j in range(context)] for i in range(rows)]
        first = engine.generate(prompts, SamplingParams(1, []), sessions=sessions, seeds=seeds)  # the prefill
        prompts = [p + out.tokens for p, out in zip(prompts, first)]
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(new, [], temperature=1.0), sessions=sessions, seeds=seeds)
        return time.perf_counter() - t
    finally:
        engine.close()


def measure(args: argparse.Namespace) -> dict:
    import torch

    from bench.engines import rates_each_way
    from launch.warmstart import ensure_warmstart

    torch.set_num_threads(1)
    out: dict = {}
    for r in range(args.rounds):
        for env in [e for e in args.envs.split(",") if e]:
            path = args.model or ensure_warmstart(log=print, env=env)
            rates = rates_each_way(out, r, env, path, args, "growing_kv", CACHES)
            out.setdefault(f"ratio_{env}", []).append(ratio(rates["growing"], rates["dynamic"]))
            print(f"round {r} {env}: {rates['dynamic']:.2f} trajectories/s on DynamicCache, "
                  f"{rates['growing']:.2f} growing", flush=True)
        path = args.model or ensure_warmstart(log=print, env="maze")
        for context in args.contexts:
            times = {name: decode_s(path, growing, args.rows, context, args.new) for name, growing in CACHES.items()}
            for name, v in times.items():
                out.setdefault(f"decode_s_{context}_{name}", []).append(sig(v))
            out.setdefault(f"ratio_decode_{context}", []).append(ratio(times["dynamic"], times["growing"]))
            print(f"round {r}, {args.rows} rows decoding {args.new} tokens after {context}: {times['dynamic']:.3f} s "
                  f"on DynamicCache, {times['growing']:.3f} s growing", flush=True)
    return with_medians(out)


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(measure(parse(argv))))


if __name__ == "__main__":
    main()
