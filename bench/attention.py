"""`python -m bench.attention`: what grouped-query attention without repeated key-value heads
(policy/attention.py) buys the torch engine and the learner on the CPU.

The same model twice in each round, on transformers' "sdpa" attention (which repeats every
key-value head for its query heads whenever a mask is given) and on policy/attention.py's
(`enable_gqa`, the heads as they are), alternating so that the machine's drift falls on both:

- actor: one actor with the torch engine plays --groups timed groups (after --warmup) of the
  image maze and of the text maze, groups of --group-size (the image maze's 16), with its
  warm-start policy (bench/engines.py's `rate`: trajectories a second);
- learner: forward and backward of one micro-batch of --rows rows of --tokens tokens, the last
  rows right-padded as the learner's batches are, through the image maze policy's LoRA adapter
  (seconds, the median of --steps after one untimed).

Run it alone, one torch thread. --model takes another model for both (tests: a tiny one); by
default each environment's warm start, built on first use. Ends with one JSON line: each figure
for both attentions, their per-round ratios (GQA over "sdpa" for rates, "sdpa" over GQA for
times: above 1 means faster) and the ratios' medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench import ratio, sig, with_medians
from policy.attention import GQA_SDPA

ATTENTIONS = ("sdpa", GQA_SDPA)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds; each measures both attentions")
    p.add_argument("--groups", type=int, default=10, help="timed groups per actor measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed groups first")
    p.add_argument("--group-size", type=int, default=16, help="episodes a group (the image maze's 16)")
    p.add_argument("--envs", default="image-maze,maze", help="environments the actor plays")
    p.add_argument("--rows", type=int, default=16, help="rows of the learner's micro-batch")
    p.add_argument("--tokens", type=int, default=300, help="tokens a row (the image maze's mean is about 300)")
    p.add_argument("--steps", type=int, default=3, help="timed forward-backward passes a measurement")
    p.add_argument("--model", default=None, help="one model for every measurement (default: the warm starts)")
    args = p.parse_args(argv)
    if min(args.rounds, args.groups, args.group_size, args.rows, args.steps) < 1 or args.warmup < 1 or args.tokens < 8:
        p.error("--rounds, --groups, --group-size, --rows, --steps, --warmup ≥ 1 and --tokens ≥ 8 are required")
    return args


def _model(args, env: str) -> str:
    if args.model is not None:
        return args.model
    from launch.warmstart import ensure_warmstart

    return ensure_warmstart(log=print, env=env)


def learner_pass_s(model_path: str, attention: str, rows: int, tokens: int, steps: int) -> float:
    """Median seconds of a forward and backward pass through a fresh LoRA adapter on `attention`."""
    import torch

    from policy.load import LoraSpec, load_model, with_lora

    torch.manual_seed(0)
    model = with_lora(load_model(model_path), LoraSpec())
    model.get_base_model().set_attn_implementation(attention)
    vocab = model.get_base_model().config.get_text_config().vocab_size
    ids = torch.randint(3, min(vocab, 1000), (rows, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    padded = range(rows // 2, rows)  # the second half right-padded, by more each row, up to half
    for j, i in enumerate(padded, 1):
        mask[i, tokens - j * tokens // (2 * len(padded)):] = 0
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits.float().logsumexp(-1) * mask).mean().backward()
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def measure(args: argparse.Namespace) -> dict:
    import torch

    from bench.engines import rate

    torch.set_num_threads(1)
    envs = [e for e in args.envs.split(",") if e]
    out: dict = {}
    for r in range(args.rounds):
        for env in envs:
            path = _model(args, env)
            rates = {a: rate("torch", path, args.warmup, args.groups, r, env, args.group_size, a) for a in ATTENTIONS}
            for a, v in rates.items():
                out.setdefault(f"traj_per_s_{env}_{a}", []).append(sig(v))
            out.setdefault(f"actor_ratio_{env}", []).append(ratio(rates[GQA_SDPA], rates["sdpa"]))
            print(f"round {r} {env}: {rates['sdpa']:.2f} trajectories/s on sdpa, {rates[GQA_SDPA]:.2f} on "
                  f"{GQA_SDPA}", flush=True)
        path = _model(args, envs[0] if envs else "image-maze")
        times = {a: learner_pass_s(path, a, args.rows, args.tokens, args.steps) for a in ATTENTIONS}
        for a, v in times.items():
            out.setdefault(f"learner_pass_s_{a}", []).append(sig(v))
        out.setdefault("learner_ratio", []).append(ratio(times["sdpa"], times[GQA_SDPA]))
        print(f"round {r} learner: {times['sdpa']:.3f} s on sdpa, {times[GQA_SDPA]:.3f} s on {GQA_SDPA}", flush=True)
    return with_medians(out)


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(measure(parse(argv))))


if __name__ == "__main__":
    main()
