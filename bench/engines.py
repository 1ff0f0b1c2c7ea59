"""`python -m bench.engines`: trajectories per second of each engine on the maze, same run,
for the text maze and the image maze.

One actor (the real `actors.actor.Actor`, default settings: 4 groups of 8 in
flight) plays the maze with the built-in maze policy through a LoRA adapter
(zeros: the warm start's policy, with the adapter's computation running as it
does in a training run), once with the torch engine and once with vLLM, with
the same seeds. Replay is a stand-in that grants every credit at once and
notes when each group is pushed, so the figure is the actor's own rate. The
first `--warmup` groups an engine pushes are not timed (engine start,
warm-up); the rate is over the `--groups` pushed after them. Run it alone: the
engine's processes and the environments' threads share the machine. The image
path is the same with the image maze and the built-in vision-language warm start
(`builtin:vlm`): each turn's picture goes to the engine with its tokens.

Ends with one JSON line: {"traj_per_s_torch": ..., "traj_per_s_vllm": ..., "ratio": vllm / torch,
"traj_per_s_torch_image": ..., "traj_per_s_vllm_image": ..., "ratio_image": ...}.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from bench import sig


class _Replay:
    """Every credit asked for is granted at once (version 0); pushed groups are timed."""

    def __init__(self) -> None:
        self.wanted = 0
        self.pushed: list[tuple[float, int]] = []  # (when, trajectories) of each group pushed
        self._lock = threading.Lock()

    def hello(self) -> None:
        pass

    def request_credit(self) -> None:
        with self._lock:
            self.wanted += 1

    def credits(self, timeout: float) -> list[int]:
        with self._lock:
            granted, self.wanted = self.wanted, 0
        if not granted:
            time.sleep(min(timeout, 0.01))
        return [0] * granted

    def send(self, group) -> None:
        self.pushed.append((time.perf_counter(), len(group.trajectories)))

    def flush(self, timeout: float = 0.0) -> None:
        pass


class _Weights:
    """One adapter, version 1, from the start: a run's engines always sample with one."""

    def __init__(self, adapter) -> None:
        self.adapter = adapter

    def poll(self):
        return None

    def wait(self, timeout: float):
        return None

    def latest(self, timeout: float):
        return self.adapter


def rate(kind: str, model_path: str, warmup: int, groups: int, seed: int, env: str = "maze",
         group_size: int | None = None, attention: str | None = None, **engine_options) -> float:
    """Trajectories per second of one actor with engine `kind` on `env` over `groups` timed groups
    (of `group_size` episodes: the actor's default if None); `attention`: the torch engine's
    model switched to that transformers attention implementation (None: as loaded);
    `engine_options`: the engine's own keyword arguments, over the config's."""
    from actors.actor import Actor, ActorConfig
    from actors.engines import make_engine
    from bench.parity import random_adapter
    from envs import make_env
    from launch.config import Config
    from policy.load import load_chat
    from policy.adapter import Adapter

    cfg = Config()
    actor_cfg = ActorConfig(engine=kind) if group_size is None else ActorConfig(engine=kind, group_size=group_size)
    # The warm start's policy through a LoRA adapter (A = B = 0): the adapter's computation
    # runs, as it does from the first update of a run on, and the episodes are the warm start's.
    adapter = {k: v.zero_() for k, v in random_adapter(model_path, cfg.learner.lora).items()}
    engine = make_engine(kind, model_path, cfg.learner.lora, seed=seed,
                         **{**actor_cfg.engine_options(), **engine_options})
    if attention is not None:
        engine.model.get_base_model().set_attn_implementation(attention)
    try:
        chat = load_chat(model_path)
        kwargs = cfg.env_kwargs()
        replay = _Replay()
        actor = Actor(actor_cfg, kind, engine, chat, lambda: make_env(env, **kwargs), replay,
                      _Weights(Adapter(1, model_path, cfg.learner.lora.to_dict(), adapter)), seed=seed)
        actor.run(threading.Event(), max_groups=warmup + groups)
        (t0, _), timed = replay.pushed[warmup - 1], replay.pushed[warmup:]
        return sum(n for _, n in timed) / (timed[-1][0] - t0)
    finally:
        engine.close()


def rates_each_way(out: dict, r: int, env: str, path: str, args, option: str, ways: dict) -> dict[str, float]:
    """Round `r` of a bench that times one torch-engine actor on `env` (`rate` with args.warmup,
    args.groups, args.group_size) once for each of `ways` (name → the engine's keyword `option`),
    in the ways' order on even rounds and reversed on odd ones, so that the machine's drift falls
    on all of them. Appends each rate to out["traj_per_s_<env>_<name>"]; returns the rates."""
    order = list(ways.items()) if r % 2 == 0 else list(ways.items())[::-1]
    rates = {name: rate("torch", path, args.warmup, args.groups, r, env, args.group_size, **{option: value})
             for name, value in order}
    for name in ways:
        out.setdefault(f"traj_per_s_{env}_{name}", []).append(sig(rates[name]))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=48, help="timed groups per engine")
    parser.add_argument("--warmup", type=int, default=8, help="untimed groups per engine first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--envs", default="maze,image-maze", help="the text maze, the image maze, or both")
    args = parser.parse_args()

    import torch

    from launch.warmstart import ensure_warmstart

    torch.set_num_threads(1)
    result = {}
    for env in args.envs.split(","):
        model_path = ensure_warmstart(log=print, env=env)
        tail = "_image" if env == "image-maze" else ""
        for kind in args.engines.split(","):
            r = rate(kind, model_path, args.warmup, args.groups, args.seed, env)
            print(f"{kind} ({env}): {r:.1f} trajectories/s over {args.groups} groups", flush=True)
            result[f"traj_per_s_{kind}{tail}"] = round(r, 2)
        if f"traj_per_s_torch{tail}" in result and f"traj_per_s_vllm{tail}" in result:
            result[f"ratio{tail}"] = round(result[f"traj_per_s_vllm{tail}"] / result[f"traj_per_s_torch{tail}"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
