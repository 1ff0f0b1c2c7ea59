"""`python -m bench.accumulate`: a 2-rank learner step with --learner.keep-gathered (or, with
`--option fused-lora`, --learner.fused-lora; with `--option bf16`, --learner.dtype bfloat16
against float32) on and off.

Gradient accumulation under FSDP2 gathers every unit's parameters twice a micro-batch (forward and
backward) and reduce-scatters its gradients once a micro-batch. With --learner.keep-gathered the
parameters gathered for an update's first micro-batch stay until its last and the gradients are
reduced once, after the last. With --learner.fused-lora a LoRA layer whose adapter is not thin
next to its weight is computed as one linear map with W + s·B·A (learner/model.py). With
--learner.dtype bfloat16 the frozen weights are stored and the step computed in bfloat16 (FSDP2's
mixed precision), LoRA and the optimizer's state in float32; fused LoRA is float32 only, so the
float32 variant has it and the bfloat16 one does not, as in a run with each. This bench
times the real learner's step both ways: two ranks over gloo (one torch thread each), fed by a
real replay service, on image-maze groups that the torch engine played with the built-in
vision-language model (`--model`, `builtin:tiny-vlm` by default: built locally, nothing
downloaded; `builtin:vlm` is the image maze's warm start). The groups are played once
(--group-size episodes each, up to --turns moves); their rewards are then set to 1, 0, 1, ... so
that every row trains (this bench measures a step's cost, not learning), and every step gets
copies of them under new ids.

Each variant runs in fresh rank processes: --warmup untimed steps, then --steps timed ones; the
figure is their mean wall time and each rank's CPU time a step. --load N starts N busy processes
beside the ranks for the whole bench (both variants), as a run's actors share the cores with its
learners. The variants take turns for --rounds rounds, "off" first in odd rounds and "on" first
in even ones. The last line is one JSON object: step_s and cpu_s of each variant (means over
rounds), their ratios (off / on) per round, and the step's loss both ways (the same updates:
equal up to float summation order). The other option stays at its default in both variants.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

from bench import ratio, sig, with_medians

VARIANTS = ("off", "on")
OPTIONS = {"keep-gathered": ("keep_gathered", {"off": "off", "on": "on"}),
           "fused-lora": ("fused_lora", {"off": False, "on": True}),
           "bf16": ("dtype", {"off": "float32", "on": "bfloat16"})}
"""--option: the LearnerConfig field it sets, and its value in each variant."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.accumulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--option", choices=sorted(OPTIONS), default="keep-gathered",
                   help="the learner option set off and on (keep-gathered)")
    p.add_argument("--model", default="builtin:tiny-vlm", help="a vision-language model (builtin:tiny-vlm)")
    p.add_argument("--groups", type=int, default=8, help="groups a step, over both ranks (8: the image maze's)")
    p.add_argument("--group-size", type=int, default=16, help="episodes a group (16: the image maze's)")
    p.add_argument("--turns", type=int, default=12, help="moves an episode at most (12: the image maze's)")
    p.add_argument("--micro-batch", type=int, default=8, help="--learner.micro-batch (8)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--steps", type=int, default=3, help="timed steps a variant and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both variants, alternating")
    p.add_argument("--load", type=int, default=0, help="busy processes beside the ranks (a run's actors)")
    args = p.parse_args(argv)
    if min(args.groups, args.group_size - 1, args.turns, args.micro_batch, args.steps, args.rounds) < 1 \
            or args.warmup < 0 or args.load < 0 or args.groups % 2:
        p.error("--groups must be even and positive, --group-size at least 2, --turns, --micro-batch, --steps "
                "and --rounds positive, --warmup and --load 0 or more")
    return args


def play_groups(model: str, groups: int, group_size: int, turns: int) -> list:
    """`groups` image-maze groups the torch engine plays at temperature 0.7 from `model` (its
    base weights), rewards then set to 1, 0, 1, ... (every row trains)."""
    import dataclasses
    import torch

    from actors.engine import SamplingParams
    from actors.envrunner import EnvRunner
    from actors.rollout import close, play, start
    from actors.torch_engine import TorchEngine
    from envs import make_env
    from policy.load import LoraSpec, load_chat
    from replay.wire import Group

    torch.set_num_threads(1)
    engine, chat, runner = TorchEngine(model, LoraSpec(), seed=0), load_chat(model), EnvRunner(threads=2)
    params = SamplingParams(8, chat.stop_ids, temperature=0.7)
    out = []
    try:
        for g in range(groups):
            episodes = [start(make_env("image-maze", max_steps=turns), chat, runner, seed=1000 + g,
                              sampling_seed=group_size * g + j) for j in range(group_size)]
            play(engine, chat, episodes, params, 4096, runner)
            for e in episodes:
                close(e)
            trajs = [dataclasses.replace(e.trajectory(), reward=float((j + 1) % 2))
                     for j, e in enumerate(episodes)]
            out.append(Group(f"g{g}", f"seed={1000 + g}", trajs, actor="bench"))
    finally:
        runner.close()
        engine.close()
    return out


def _rank(rank: int, url: str, model: str, endpoint: str, args: argparse.Namespace, variant: str, out) -> None:
    """One rank's steps; puts (rank, figures) or (rank, {"error": ...}) in `out`, then ends the process."""
    import traceback

    code = 1
    try:
        _steps(rank, url, model, endpoint, args, variant, out)
        code = 0
    except BaseException:
        out.put((rank, {"error": traceback.format_exc()}))
    finally:
        out.close()
        out.join_thread()
        os._exit(code)  # no interpreter teardown racing the process group's threads


def _steps(rank: int, url: str, model: str, endpoint: str, args: argparse.Namespace, variant: str, out) -> None:
    import torch

    from learner.config import LearnerConfig
    from learner.trainer import Learner
    from replay.zmq_client import ZmqLearnerReplay

    torch.set_num_threads(1)
    torch.manual_seed(0)
    field, values = OPTIONS[args.option]
    cfg = LearnerConfig(groups_per_step=args.groups, micro_batch=args.micro_batch, **{field: values[variant]},
                        device="cpu", threads=1)
    learner = Learner(cfg, model, rank, 2, url, ZmqLearnerReplay(endpoint), temperature=0.7)
    try:
        learner.setup()
        walls, cpus, losses = [], [], []
        for k in range(args.warmup + args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = learner.step()
            if k >= args.warmup:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            losses.append(metrics["loss"])
        out.put((rank, {"step_s": sum(walls) / len(walls), "cpu_s": sum(cpus) / len(cpus), "losses": losses}))
    finally:
        learner.close()


def run_variant(model: str, groups: list, args: argparse.Namespace, variant: str) -> dict:
    """One variant's steps on two fresh ranks; {"step_s", "cpu_s" (mean of the ranks), "losses"}."""
    import dataclasses

    from replay.buffer import ReplayBuffer
    from replay.server import ReplayServer
    from replay.zmq_client import ZmqActorReplay

    server = ReplayServer(ReplayBuffer(groups_per_step=args.groups, max_staleness=10**6, num_shards=2),
                          "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqActorReplay(endpoint, actor="bench")
        for k in range(args.warmup + args.steps):
            for g in groups:
                client.push(dataclasses.replace(g, group_id=f"{g.group_id}-{variant}-{k}"))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        procs = [ctx.Process(target=_rank, args=(r, url, model, endpoint, args, variant, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join(60)
        errors = [r["error"] for r in results.values() if "error" in r]
        if errors or [p.exitcode for p in procs] != [0, 0]:
            raise SystemExit(f"a rank of the {variant} variant failed:\n{errors[0] if errors else ''}")
    finally:
        server.stop()
    return {"step_s": max(r["step_s"] for r in results.values()),
            "cpu_s": sum(r["cpu_s"] for r in results.values()) / 2, "losses": results[0]["losses"]}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from policy.load import resolve_model

    model = resolve_model(args.model)
    print(f"accumulate bench: --learner.{args.option} off and on; {args.model}, {args.groups} groups of {args.group_size} a step ({args.micro_batch} "
          f"rows a micro-batch) on 2 ranks; {args.warmup} warm-up + {args.steps} timed steps a variant, "
          f"{args.rounds} rounds; {args.load} busy processes beside", flush=True)
    groups = play_groups(model, args.groups, args.group_size, args.turns)
    tokens = [int(t.tokens.size) for g in groups for t in g.trajectories]
    print(f"played {len(tokens)} episodes, {sum(tokens) / len(tokens):.0f} tokens on average", flush=True)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        rounds = []
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # the machine's drift falls on both
            res = {variant: run_variant(model, groups, args, variant) for variant in order}
            rounds.append(res)
            print(f"round {r + 1}: " + ", ".join(f"{args.option} {k}: step {v['step_s']:.2f}s, "
                                                   f"{v['cpu_s']:.2f} CPU-s a rank" for k, v in res.items()), flush=True)
    finally:
        for p in load:
            p.kill()
    figures = {"option": args.option, "model": args.model, "load": args.load, "groups": args.groups, "group_size": args.group_size,
               "mean_tokens": round(sum(tokens) / len(tokens))}
    for variant in VARIANTS:
        figures[f"step_s_{variant}"] = sig(sum(x[variant]["step_s"] for x in rounds) / len(rounds))
        figures[f"cpu_s_{variant}"] = sig(sum(x[variant]["cpu_s"] for x in rounds) / len(rounds))
        figures[f"loss_{variant}"] = rounds[0][variant]["losses"]
    figures["step_ratio"] = [ratio(x["off"]["step_s"], x["on"]["step_s"]) for x in rounds]
    figures["cpu_ratio"] = [ratio(x["off"]["cpu_s"], x["on"]["cpu_s"]) for x in rounds]
    print(json.dumps(with_medians(figures)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
