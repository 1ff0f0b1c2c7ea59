"""`python -m bench.model_step`: what chunked log-probs save in one learner step at a real model size.

One training step (forward, backward, optimizer, publish) of the real learner (a world-1 gloo
FSDP2 `Learner`, its `step`, fed by an in-process replay) on a randomly initialised model of
Qwen2.5-0.5B's exact shape (24 layers, hidden 896, 14 heads over 2 key-value heads, MLP 4864,
vocabulary 151,936, tied embeddings; built from a Qwen2Config by the learner itself, sharded and
randomly initialised, nothing downloaded or saved, no tokenizer), in float32, twice, each in a
fresh process of this script: with --learner.logit-chunk (log-probs and entropy from the last
hidden state, chunk by chunk) and with --learner.logit-chunk 0 (the whole [b, T, V] logits, as
before). --activation-checkpointing turns on --learner.activation-checkpointing in both. The batch is one group of --rows trajectories of --tokens tokens (random
tokens, the last three quarters model tokens, rewards 1, 0, 1, 0, ... so that every row trains),
all in one micro-batch.

Each child builds its learner, runs --warmup steps, then times --steps steps (the figure is their
mean; model building and loading are left out). Peak memory is the child's peak resident set
(VmHWM) over the steps: the high-water mark is reset after the learner is set up (Linux
/proc/self/clear_refs), so loading the model does not count; where that is refused it is the
whole child's ru_maxrss, and `peak_scope` says "process". The last line is one JSON object:
peak_rss_mb_chunked, peak_rss_mb_unchunked, step_s_chunked, step_s_unchunked, their ratios, the
resident set after setup (the model and optimizer, the same for both), and the shape used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench import ratio, sig

VARIANTS = ("chunked", "unchunked")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.model_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4, help="trajectories in the batch (at least 2)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per trajectory")
    p.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B: 24)")
    p.add_argument("--hidden", type=int, default=896, help="hidden size (896)")
    p.add_argument("--intermediate", type=int, default=4864, help="MLP size (4864)")
    p.add_argument("--heads", type=int, default=14, help="attention heads (14)")
    p.add_argument("--kv-heads", type=int, default=2, help="key-value heads (2)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (151,936)")
    p.add_argument("--logit-chunk", type=int, default=1024, help="--learner.logit-chunk of the chunked run")
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="--learner.micro-batch-tokens (0: every row in one micro-batch)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="--learner.activation-checkpointing in both runs (the logits then dominate)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--steps", type=int, default=1, help="timed steps (their mean is step_s)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads of the learner")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rows < 2:
        p.error("--rows must be at least 2: GRPO skips a group whose rewards are all equal")
    if args.tokens < 8 or args.layers < 1 or args.steps < 1 or args.warmup < 0 or args.logit_chunk < 1:
        p.error("--tokens ≥ 8, --layers ≥ 1, --steps ≥ 1, --warmup ≥ 0 and --logit-chunk ≥ 1 are required")
    return args


def model_config(args: argparse.Namespace):
    """Qwen2.5-0.5B's configuration (its config.json), at the requested shape."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1, pad_token_id=args.vocab - 1)


def synthetic_group(vocab: int, rows: int, tokens: int, seed: int, actor: str = "bench"):
    """One GRPO group of random tokens: a quarter prompt, then model tokens; rewards 1, 0, 1, …
    (so that every row trains)."""
    import uuid

    import numpy as np

    from replay.wire import Group, Trajectory

    rng = np.random.default_rng(seed)
    mask = (np.arange(tokens) >= tokens // 4).astype(np.uint8)  # a prompt, then model tokens
    trajs = [Trajectory(tokens=rng.integers(0, vocab - 1, tokens).astype(np.int32),
                        logprobs=np.where(mask, -3 * rng.random(tokens), 0).astype(np.float32), mask=mask,
                        versions=np.zeros(tokens, np.int32), reward=float((i + 1) % 2), turns=1,
                        finish_reason="terminated") for i in range(rows)]
    return Group(uuid.uuid4().hex, f"{actor}-{seed}", trajs, actor=actor)


def world1_learner(cfg, base_config, name: str, temperature: float = 1.0):
    """A world-1 `Learner` (gloo or NCCL by `cfg.device`) on a randomly initialised model of
    `base_config` (or, with None, the model saved at `name`), fed by an in-process replay:
    (learner, replay), the learner not set up yet. Push a group to the replay before each
    `learner.step()`."""
    import socket

    import torch

    from learner.trainer import Learner
    from replay.buffer import ReplayBuffer
    from replay.client import LocalReplay
    from weights.publisher import WeightPublisher

    replay = LocalReplay(ReplayBuffer(groups_per_step=1, max_staleness=1_000_000), actor="bench")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    torch.manual_seed(0)
    # A real publisher, as rank 0 of a run has: a step's figures include publishing (bench closes it).
    return Learner(cfg, name, 0, 1, url, replay, temperature=temperature, base_config=base_config,
                   publisher=WeightPublisher()), replay


def _status_mb(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def child(args: argparse.Namespace) -> dict:
    """One variant's steps in this (fresh) process; returns its figures."""
    import resource

    from learner.config import LearnerConfig

    chunk = args.logit_chunk if args.child == "chunked" else 0
    cfg = LearnerConfig(groups_per_step=1, micro_batch=args.rows, micro_batch_tokens=args.micro_batch_tokens,
                        logit_chunk=chunk, threads=args.threads, device="cpu", dtype="float32",
                        activation_checkpointing=args.activation_checkpointing)
    learner, replay = world1_learner(cfg, model_config(args), "bench:qwen2.5-0.5b-shape")
    try:
        learner.setup()
        setup_mb = _status_mb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set: the steps' peak, not the loading's
            scope = "steps"
        except OSError:
            scope = "process"
        times, metrics = [], {}
        for k in range(args.warmup + args.steps):
            replay.push(synthetic_group(args.vocab, args.rows, args.tokens, k))
            t0 = time.perf_counter()
            metrics = learner.step()
            if k >= args.warmup:
                times.append(time.perf_counter() - t0)
        if scope == "steps":
            peak_mb = _status_mb("VmHWM")
        else:
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finally:
        learner.close()
        learner.publisher.close()
    return {"variant": args.child, "logit_chunk": chunk, "peak_rss_mb": round(peak_mb, 1),
            "setup_rss_mb": round(setup_mb, 1), "step_s": sig(sum(times) / len(times)),
            "train_s": sig(metrics["train_s"]), "loss": metrics["loss"], "peak_scope": scope}


def _run_child(args: argparse.Namespace, variant: str, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.model_step", *argv, "--child", variant]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the {variant} run failed (exit code {proc.returncode}); its output:\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    shape = (f"{args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, {args.heads}/{args.kv_heads} "
             f"heads, vocabulary {args.vocab}")
    print(f"model step bench: {shape}; {args.rows} trajectories × {args.tokens} tokens; logit chunk "
          f"{args.logit_chunk} against the whole logits; {args.warmup} warm-up + {args.steps} timed step(s), "
          f"{args.threads} thread(s), float32"
          f"{', activation checkpointing' if args.activation_checkpointing else ''}", flush=True)
    out = {}
    for variant in VARIANTS:
        r = _run_child(args, variant, argv)
        out[variant] = r
        print(f"{variant:>9} (logit chunk {r['logit_chunk']}): peak {r['peak_rss_mb']:.0f} MB over the steps "
              f"({r['peak_scope']}), {r['setup_rss_mb']:.0f} MB after setup, step {r['step_s']:.2f}s, "
              f"loss {r['loss']:.4f}", flush=True)
    c, u = out["chunked"], out["unchunked"]
    print(json.dumps({
        "peak_rss_mb_chunked": c["peak_rss_mb"], "peak_rss_mb_unchunked": u["peak_rss_mb"],
        "step_s_chunked": c["step_s"], "step_s_unchunked": u["step_s"],
        "peak_ratio": ratio(u["peak_rss_mb"], c["peak_rss_mb"]), "step_ratio": ratio(u["step_s"], c["step_s"]),
        "setup_rss_mb_chunked": c["setup_rss_mb"], "setup_rss_mb_unchunked": u["setup_rss_mb"],
        "loss_chunked": c["loss"], "loss_unchunked": u["loss"], "peak_scope": c["peak_scope"],
        "rows": args.rows, "tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab,
        "logit_chunk": args.logit_chunk, "activation_checkpointing": args.activation_checkpointing,
        "dtype": "float32", "warmup_steps": args.warmup, "timed_steps": args.steps,
        "threads": args.threads}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
