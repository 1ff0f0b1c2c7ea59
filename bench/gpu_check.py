"""`python -m bench.gpu_check`: does the learner train real model sizes on this GPU?

Three checks on one CUDA device, no network, no Ray, each in a fresh process of this script
(a failure or an out-of-memory in one does not hide the others; peak memory is per check):

  step_0.5b   one NCCL learner step (world 1: the real `Learner`, its `step`, an in-process
              replay serving a synthetic batch) of a randomly initialised model of Qwen2.5-0.5B's
              shape (Qwen2Config: hidden 896, 24 layers, 14/2 heads, MLP 4864, vocabulary 151,936,
              tied embeddings), bf16 mixed precision: step time (mean of --steps after one
              warm-up step) and peak GPU memory.
  8b, 8b_ac   the peak GPU memory of one training step of a Qwen3-8B-shaped model (hidden 4096,
              36 layers, 32/8 heads, head_dim 128, MLP 12288, vocabulary 151,936, untied), bf16,
              LoRA r=32 on all linear layers, a batch of --rows × --tokens tokens in one
              micro-batch; without and with --learner.activation-checkpointing.
  parity      the torch engine on CUDA (bf16 and fp32) against the learner's scoring of the
              same tokens (bench/parity.py: built-in model, random adapter): max |log μ − log π|
              and the mismatch KL.

  image       the image path: the torch engine plays image-maze episodes of the built-in tiny
              vision-language model (`builtin:tiny-vlm`, Idefics3's shape) in the learner's dtype,
              and a world-1 learner scores exactly those tokens and pictures (max |log μ − log π|,
              the mismatch KL, and the same with grey pictures, which must differ), then trains
              one GRPO step on them, their rewards set to 1, 0, 1, 0 (its loss and that the
              adapter changed).

  colocated, parity_vllm, two_engines
              vLLM on the GPU (bench/gpu_vllm.py): a colocated learner and sleeping engine over
              three cycles (room before each wake, greedy tokens equal across a sleep), vLLM's
              log μ against the learner's in bf16, two engines started at once on one GPU.
              Skipped without CUDA.

Peak memory is `torch.cuda.max_memory_allocated` over the steps, reset after the model is set
up (the setup's own figure is reported beside it). Ends with one JSON line; keys ending in _gb
are GiB.

Exit status: 0 when every check ran; 1 when one failed (its key "error" says why); 0 at once
with {"gpu": false, ...} when there is no CUDA device: the check needs one. `--device cpu --tiny`
runs the same code on tiny shapes on the CPU (gloo, no memory figures): the CI smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench import sig

VLLM_CHECKS = ("colocated", "parity_vllm", "two_engines")
CHECKS = ("step_0.5b", "8b", "8b_ac", "parity", "image", *VLLM_CHECKS)

SHAPES = {
    "0.5b": dict(kind="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(kind="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
}
TINY = {
    "0.5b": dict(kind="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "8b": dict(kind="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=False),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4, help="trajectories in the 8B step's batch")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per trajectory of the 8B step")
    p.add_argument("--steps", type=int, default=2, help="timed steps of the 0.5B check (after one warm-up)")
    p.add_argument("--prompts", type=int, default=32, help="prompts of the parity check")
    p.add_argument("--timeout", type=int, default=110,
                   help="seconds each check may take (most take far less: within 8 minutes in all)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"which of {', '.join(CHECKS)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        p.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    if args.rows < 2 or args.tokens < 8 or args.steps < 1:
        p.error("--rows ≥ 2 (GRPO skips a group whose rewards are all equal), --tokens ≥ 8 and --steps ≥ 1")
    return args


def model_config(shape: dict):
    """A transformers config of `shape` (SHAPES / TINY), nothing downloaded."""
    from transformers import Qwen2Config, Qwen3Config

    shape = dict(shape)
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[shape.pop("kind")]
    last = shape["vocab_size"] - 1
    return cls(**shape, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
               bos_token_id=last, eos_token_id=last, pad_token_id=last)


def learner_steps(config, device: str, rows: int, tokens: int, warmup: int, steps: int,
                  checkpointing: bool = False, name: str = "random") -> dict:
    """`warmup` + `steps` steps of a world-1 `Learner` on a random model of `config` (bf16 mixed
    precision): mean step seconds, peak and setup GPU memory (GiB; None on the CPU), last loss."""
    import torch

    from bench.model_step import synthetic_group, world1_learner
    from learner.config import LearnerConfig

    cuda = device == "cuda"
    cfg = LearnerConfig(groups_per_step=1, micro_batch=rows, device=device, dtype="bfloat16",
                        activation_checkpointing=checkpointing, lr_schedule="constant")
    learner, replay = world1_learner(cfg, config, f"random:{name}")
    try:
        learner.setup()
        if cuda:
            torch.cuda.synchronize()
            setup_gb = torch.cuda.memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        times, metrics = [], {}
        for k in range(warmup + steps):
            replay.push(synthetic_group(config.vocab_size, rows, tokens, k, actor="gpu-check"))
            t0 = time.perf_counter()
            metrics = learner.step()
            if cuda:
                torch.cuda.synchronize()
            if k >= warmup:
                times.append(time.perf_counter() - t0)
        peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    finally:
        learner.close()
        learner.publisher.close()
    loss = _finite(float(metrics["loss"]), "the step's")
    return {"step_s": sig(sum(times) / len(times)), "peak_gb": None if peak_gb is None else round(peak_gb, 3),
            "setup_gb": round(setup_gb, 3) if cuda else None, "loss": loss,
            "params_m": round(sum(p.numel() for p in learner.model.parameters()) / 1e6, 1)}


def parity(device: str, prompts: int) -> dict:
    """bench/parity.py's comparison with the torch engine on `device`, in bf16 and in fp32: the
    engine's log μ of its own tokens against the learner's scoring of them in the same dtype on
    the same device (bf16 is the learner's default on CUDA)."""
    import torch

    from actors.engine import SamplingParams
    from actors.engines import make_engine
    from bench.parity import compare, prompts_for, random_adapter
    from policy.load import load_chat, resolve_model
    from policy.load import LoraSpec

    model_path = resolve_model("builtin:tiny")
    lora = LoraSpec()
    chat = load_chat(model_path)
    tensors = random_adapter(model_path, lora)
    params = SamplingParams(16, chat.stop_ids, temperature=0.7)
    out = {}
    for dtype in ("bfloat16", "float32"):
        torch.manual_seed(0)
        engine = make_engine("torch", model_path, lora, device=device, dtype=dtype)
        try:
            r = compare(engine, model_path, lora, tensors, prompts_for(chat, prompts), params, device, dtype)
        finally:
            engine.close()
        short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
        out[f"torch_{short}_max_abs"], out[f"torch_{short}_kl"] = r["max_abs"], r["kl"]
        out["tokens"] = r["tokens"]
    return out


def image_maze_groups(engine, chat, runner, n: int, params) -> list:
    """`n` GRPO groups of 4 image-maze episodes (4 turns at most) that `engine` plays with `params`."""
    from actors.rollout import close, play, start
    from envs import make_env
    from replay.wire import Group

    groups = []
    for g in range(n):
        episodes = [start(make_env("image-maze", max_steps=4), chat, runner, seed=100 + g, sampling_seed=4 * g + j)
                    for j in range(4)]
        play(engine, chat, episodes, params, 2048, runner)
        for e in episodes:
            close(e)
        groups.append(Group(f"g{g}", f"seed={100 + g}", [e.trajectory() for e in episodes]))
    return groups


def _finite(loss: float, what: str) -> float:
    if loss != loss or abs(loss) == float("inf"):
        raise RuntimeError(f"{what} loss is {loss}")
    return loss


def image(device: str, groups: int) -> dict:
    """The `image` check (module docstring): engine and learner on `device`, both in bf16 on CUDA."""
    import numpy as np
    import torch

    from actors.engine import SamplingParams
    from actors.engines import make_engine
    from actors.envrunner import EnvRunner
    from bench.model_step import world1_learner
    from learner.batch import collate
    from learner.config import LearnerConfig
    from learner.losses import mismatch_kl
    from policy.load import LoraSpec, load_chat, resolve_model

    dtype = "bfloat16" if device == "cuda" else "float32"
    model_path, lora, temperature = resolve_model("builtin:tiny-vlm"), LoraSpec(), 0.7
    chat, runner = load_chat(model_path), EnvRunner(threads=4)
    engine = make_engine("torch", model_path, lora, device=device, dtype=dtype, seed=1)
    try:
        played = image_maze_groups(engine, chat, runner, groups, SamplingParams(8, chat.stop_ids, temperature=temperature))
        for group in played:  # rewards 1, 0, 1, 0 whatever the random model did: every row trains
            for i, t in enumerate(group.trajectories):
                t.reward = float((i + 1) % 2)
    finally:
        runner.close()
        engine.close()
    cfg = LearnerConfig(groups_per_step=groups, device=device, dtype=dtype, lr_schedule="constant", lr=1e-2)
    learner, replay = world1_learner(cfg, None, model_path, temperature=temperature)
    try:
        learner.setup()
        batch = collate(played, 0, learner.pad_id)
        rows = list(range(len(batch.tokens)))
        tokens, attention, pixels, width = learner._inputs(batch, rows)
        mask = batch.mask[:, :width].bool().to(tokens.device)
        behaviour = batch.behaviour[:, :width].to(tokens.device)
        with torch.no_grad():
            logp = learner._policy_terms(tokens, attention, pixels)[0].float()
            grey = learner.scheme.pixels([[np.full_like(img, 128) for img in row] for row in batch.images],
                                         learner.device)
            blind = learner._policy_terms(tokens, attention, {**pixels, **grey})[0].float()
        before = {k: v.clone() for k, v in learner.adapter_tensors().items()}
        for group in played:
            replay.push(group)
        metrics = learner.step()
        after = learner.adapter_tensors()
    finally:
        learner.close()
        learner.publisher.close()
    loss = _finite(float(metrics["loss"]), "the image step's")
    return {"tokens": int(mask.sum()), "images": sum(len(row) for row in batch.images),
            "max_abs": sig(float((logp - behaviour)[mask].abs().max())),
            "kl": sig(mismatch_kl(logp, behaviour, mask.float())),
            "grey_max_abs": sig(float((blind - behaviour)[mask].abs().max())), "loss": loss,
            "adapter_changed": any(not torch.equal(before[k], after[k]) for k in before)}


def child(args: argparse.Namespace) -> dict:
    """One check in this (fresh) process."""
    import torch

    torch.set_num_threads(2 if args.device == "cpu" else 8)
    shapes = TINY if args.tiny else SHAPES
    if args.child == "step_0.5b":
        tokens = 64 if args.tiny else 1024
        return learner_steps(model_config(shapes["0.5b"]), args.device, 4, tokens, 1, args.steps, name="qwen2.5-0.5b")
    if args.child in ("8b", "8b_ac"):
        tokens = 32 if args.tiny else args.tokens
        return learner_steps(model_config(shapes["8b"]), args.device, args.rows, tokens, 0, 1,
                             checkpointing=args.child == "8b_ac", name="qwen3-8b")
    if args.child == "parity":
        return parity(args.device, 4 if args.tiny else args.prompts)
    if args.child == "image":
        return image(args.device, 2 if args.tiny else 4)
    from bench import gpu_vllm

    if gpu_vllm.skipped(args.device):
        return gpu_vllm.skipped(args.device)
    if args.child == "colocated":
        return gpu_vllm.colocated(8, args.tokens)
    if args.child == "parity_vllm":
        return gpu_vllm.parity_vllm(args.prompts)
    return gpu_vllm.two_engines()


def _run(args: argparse.Namespace, check: str, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.gpu_check", *argv, "--child", check]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    timeout = max(args.timeout, 200) if check in VLLM_CHECKS else args.timeout  # an engine's start, eager
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"took over {timeout}s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = [line for line in proc.stdout.splitlines() if line.strip()][-3:]
        return {"error": f"exit code {proc.returncode}: " + " | ".join(tail)[-600:]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: the GPU check needs one (it trains real model sizes); nothing was run")
        print(json.dumps({"gpu": False, "reason": "torch.cuda.is_available() is False", "torch": torch.__version__}))
        return 0
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"gpu check on {name}{' (tiny shapes)' if args.tiny else ''}: {args.checks}", flush=True)
    result: dict = {"gpu": args.device == "cuda", "device": name, "tiny": args.tiny, "torch": torch.__version__}
    failed = False
    t_all = time.perf_counter()
    for check in args.checks.split(","):
        t0 = time.perf_counter()
        r = _run(args, check, argv)
        failed |= "error" in r
        print(f"{check:>9}: {json.dumps(r)} ({time.perf_counter() - t0:.0f}s)", flush=True)
        result[check] = r
    if not failed and {"8b", "8b_ac"} <= set(result) and result["8b"]["peak_gb"]:
        result["ac_peak_ratio"] = round(result["8b_ac"]["peak_gb"] / result["8b"]["peak_gb"], 3)
    result.update(ok=not failed, wall_s=round(time.perf_counter() - t_all, 1))
    print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
