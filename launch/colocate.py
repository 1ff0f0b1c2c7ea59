"""Colocated mode (`--colocate`): each learner rank is also its own actor.

Before each optimizer step every rank plays its share of the step's groups with its current
weights and pushes them to replay; the step then trains on them (strictly on-policy). This
module joins the two parts, as launch/ may (learner/ and actors/ never import each other):
the learner's `generating` (learner/colocate.py) makes a sharded model usable for generation,
the actor's loop (actors/actor.py) plays the episodes.
"""

from __future__ import annotations

from learner.colocate import generating


class _Quota:
    """The actor side of replay for a colocated rank: pushes go to replay as any actor's, but
    credits are the rank's share of the current step's batch, granted here (replay's admission
    bounds how far actors run ahead of the learner; a colocated rank never does)."""

    def __init__(self, replay, version) -> None:
        self.replay, self.version = replay, version
        self.left = self.wanted = 0

    def hello(self) -> None:
        self.replay.hello()

    def request_credit(self) -> None:
        self.wanted += 1

    def credits(self, timeout: float = 0.0) -> list[int]:
        n = min(self.wanted, self.left)
        self.wanted, self.left = self.wanted - n, self.left - n
        return [self.version()] * n

    def send(self, group) -> None:
        self.replay.send(group)

    def flush(self, timeout: float) -> None:
        self.replay.flush(timeout=timeout)


class _Own:
    """The weights of a colocated rank's engine: the trainer's own, never sent anywhere."""

    def poll(self):
        return None

    def wait(self, timeout: float):
        return None

    def latest(self, timeout: float):
        return None


class Colocated:
    """A learner rank's own actor. Before each optimizer step (`Learner.before_step`) it plays
    the rank's share of the step's groups on the rank's engine, as an actor would (environments
    on threads, with time limits; a failing environment ends its episode only), and pushes them
    to replay; the step then trains on them: strictly on-policy.

    The engine is the torch engine on the rank's own model (`--actor.engine torch`: one copy of
    the model) or vLLM (`--actor.engine vllm`), which holds its own copy of the base weights on
    the rank's device: it is given the current adapter before each generation and, on GPUs, sleeps
    while the learner trains (its KV cache dropped, its weights moved to CPU memory) and wakes,
    its prefix cache emptied, for the next; or, with --actor.sleep keep (auto: once the first step
    shows it fits), stays awake beside the learner.

    Usage::

        colocated = Colocated(learner, cfg.actor, chat, make_env, actor_replay, share, seed)
        learner.before_step = colocated.generate
    """

    def __init__(self, learner, actor_cfg, chat, make_env, replay, share: int, seed: int = 0, engine=None) -> None:
        """`engine`: a vLLM engine to generate with (tests share one); by default the one
        `actor_cfg.engine` names, on the learner's device."""
        from actors.actor import Actor

        self.learner, self.share = learner, share
        if engine is None:
            engine = _engine(learner, actor_cfg, seed)
        self.own_model = getattr(engine, "model", None) is learner.model
        self.fraction = actor_cfg.memory_fraction
        self.sleep = actor_cfg.sleep
        """--actor.sleep: "offload" or "keep" once "auto" has measured a step (`_decide`)."""
        self.generations = 0
        self.chat = chat
        self.checked_sleep = False
        self.released = 0
        """Bytes of the GPU the engine released at its last sleep: what its next wake takes back."""
        self.credits = _Quota(replay, lambda: learner.version)
        self.actor = Actor(actor_cfg, f"learner-{learner.rank}", engine, chat, make_env, self.credits, _Own(),
                           seed=seed)

    def generate(self) -> None:
        """Play this rank's share of the next step's groups with the current weights; every rank
        must call it together (gathering the model's weights is collective)."""
        import threading

        engine, learner = self.actor.engine, self.learner
        self.credits.left = self.share
        if self.own_model:
            engine.version = learner.version  # the weights are the trainer's as they stand
            engine.reset_cache()  # no key or value of the weights before this step's update
            with generating(learner.model):
                self.actor.run(threading.Event(), max_groups=self.share)
            return
        adapter = learner.published  # the snapshot each rank took when it published this version
        self._wake()
        try:
            if adapter.version > engine.version:
                engine.load_adapter(adapter.version, adapter.tensors)
            elif adapter.version < engine.version:
                raise RuntimeError(f"the colocated engine has adapter v{engine.version}, newer than the "
                                   f"learner's v{adapter.version}")
            if not self.checked_sleep and getattr(engine, "sleep_mode", False):
                self._check_sleep()
            self.actor.run(threading.Event(), max_groups=self.share)
        finally:
            self._sleep()
            self.generations += 1
            if learner.device.type == "cuda":
                import torch

                torch.cuda.reset_peak_memory_stats(learner.device)  # what the step takes, from here

    def _check_sleep(self) -> None:
        """Once, before the first generation of a sleeping engine: greedy tokens after a sleep and
        a wake must equal those before (an adapter silently not applied after a wake, vLLM issue
        53888, would have the learner train on base-model samples labelled with its version)."""
        from actors.engine import SamplingParams

        engine = self.actor.engine
        prompts = [self.chat.prompt_ids([{"role": "user", "content": f"Count to {n}."}]) for n in (3, 7)]
        greedy = SamplingParams(12, self.chat.stop_ids, temperature=0.0)
        before = [c.tokens for c in engine.generate(prompts, greedy)]
        self._sleep()
        self._wake()
        greedy_equal(before, [c.tokens for c in engine.generate(prompts, greedy)])
        self.checked_sleep = True

    def _sleep(self) -> None:
        """Put the engine to sleep, measuring on a GPU what it releases (what its wake takes back);
        with --actor.sleep keep (or auto, once it chose to) the engine stays awake."""
        engine, device = self.actor.engine, self.learner.device
        if self.sleep == "keep":
            return
        if device.type != "cuda":
            engine.sleep()
            return
        import torch

        before = torch.cuda.mem_get_info(device)[0]
        if engine.sleep():
            self.released = max(torch.cuda.mem_get_info(device)[0] - before, 0)

    def _wake(self) -> None:
        """Wake the engine. On a GPU the learner's caching allocator first returns its step's
        cached blocks (vLLM re-creates every allocation at its original size), and the rank checks
        that what the engine released at its sleep fits in what is free (a clear error instead of
        vLLM running out of memory mid-wake)."""
        engine, device = self.actor.engine, self.learner.device
        if device.type == "cuda" and getattr(engine, "asleep", False):
            import torch

            from actors.gpu_memory import check_wake

            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            held = torch.cuda.memory_reserved(device)
            if self.sleep == "auto" and self.generations:  # a step has run since the last generation
                self._decide(torch.cuda.max_memory_reserved(device), held, free, total)
            check_wake(free, self.released, held, total, self.fraction)
        engine.wake()

    def _decide(self, peak: int, held: int, free: int, total: int) -> None:
        """--actor.sleep auto, after the first step: keep the engine awake from now on when it fits
        beside the step's peak (actors/gpu_memory.py `fits_awake`), else go on offloading."""
        from actors.gpu_memory import fits_awake, gib

        self.sleep = "keep" if fits_awake(self.released, peak, held, free, total) else "offload"
        how = ("keeps its weights and KV cache on the GPU from now on" if self.sleep == "keep" else
               "goes on offloading its weights at every step (--actor.sleep keep needs a smaller "
               "--actor.memory-fraction)")
        print(f"learner-{self.learner.rank}: the colocated vLLM engine ({gib(self.released)} awake) {how}: the "
              f"step peaked at {gib(peak)} of the GPU's {gib(total)}, {gib(free)} free with the engine asleep",
              flush=True)

    def stats(self) -> dict:
        return self.actor.stats()

    def close(self) -> None:
        if not self.own_model:
            self.actor.engine.close()


def greedy_equal(before: list[list[int]], after: list[list[int]]) -> None:
    """RuntimeError naming the first prompt whose greedy tokens changed across a sleep and a wake."""
    if len(before) != len(after):
        raise RuntimeError(f"{len(before)} completions before the sleep, {len(after)} after")
    for i, (a, b) in enumerate(zip(before, after)):
        if a != b:
            raise RuntimeError(f"greedy tokens of prompt {i} changed across a sleep and a wake ({a[:8]}... then "
                               f"{b[:8]}...): the engine does not generate with the adapter it had (vLLM issue "
                               "53888); do not colocate with this vLLM version")


def _engine(learner, actor_cfg, seed: int):
    """The colocated rank's engine: the torch engine on the rank's own model, or vLLM on the
    rank's device, able to sleep."""
    from actors.engines import make_engine
    from actors.torch_engine import TorchEngine

    if actor_cfg.engine == "torch":
        return TorchEngine(learner.model_path, learner.cfg.lora, device=str(learner.device), seed=seed,
                           model=learner.model)
    if learner.device.type == "cuda":
        from actors.gpu_memory import check_room_beside

        check_room_beside(actor_cfg.memory_fraction, learner.device)
    return make_engine(actor_cfg.engine, learner.model_path, learner.cfg.lora, device=learner.device.type,
                       seed=seed, sleep_mode=actor_cfg.sleep != "keep", **actor_cfg.engine_options())
