"""Actors: adapters arrive over the real weight channel and change what the engine computes."""

import threading
import time

import pytest
import torch

from actors.actor import Actor, ActorConfig
from actors.engine import SamplingParams
from actors.torch_engine import TorchEngine
from envs import make_env
from policy.load import LoraSpec
from replay.buffer import ReplayBuffer
from replay.client import LocalReplay
from replay.wire import GREEDY_PLAYS, decode_group
from policy.adapter import Adapter
from weights.chunks import decode_adapter, encode_adapter
from weights.publisher import WeightPublisher
from weights.subscriber import WeightSubscriber

LORA = LoraSpec(rank=4)


def random_adapter(engine, version, scale=0.5, seed=0):
    from peft import get_peft_model_state_dict

    gen = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=gen) * scale
               for k, v in get_peft_model_state_dict(engine.model).items()}
    return Adapter(version, "tiny", LORA.to_dict(), tensors)


def play_groups(engine, chat, cfg: ActorConfig, make_env, max_groups: int, seed: int):
    """An actor with `cfg` plays `max_groups` groups into a replay buffer, the adapter of version 0
    (zeros: the bare model) arriving over the weight channel; returns the groups pushed, as the
    learner would decode them, and the actor's stats."""
    buffer = ReplayBuffer(groups_per_step=2, max_staleness=100)
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoints)
    actor = Actor(cfg, "actor-0", engine, chat, make_env, LocalReplay(buffer, actor="actor-0"), subscriber, seed=seed)
    try:
        publisher.publish(random_adapter(engine, version=0, scale=0.0))
        actor.run(threading.Event(), max_groups=max_groups)
    finally:
        actor.runner.close()
        subscriber.close()
        publisher.close()
    return [decode_group(e.blob) for e in buffer.queue], actor.stats()


def test_adapter_frames_round_trip_as_safetensors():
    tensors = {"a.lora_A.weight": torch.arange(6.0).reshape(2, 3)}
    back = decode_adapter(encode_adapter(Adapter(3, "base", {"r": 4}, tensors)))
    assert back.version == 3 and back.base_model == "base"
    torch.testing.assert_close(back.tensors["a.lora_A.weight"], tensors["a.lora_A.weight"])


def test_pushed_adapter_changes_the_engines_logprobs(tiny_model, chat):
    engine = TorchEngine(tiny_model, LORA)
    prompt = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    params = SamplingParams(3, chat.stop_ids, temperature=0.0)
    before = engine.generate([prompt], params)[0]
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoints)
    try:
        time.sleep(0.3)  # let the SUB socket connect before publishing
        publisher.publish(random_adapter(engine, version=1))
        adapter = subscriber.wait(10)
        assert adapter is not None and adapter.version == 1
        engine.load_adapter(adapter.version, adapter.tensors)
        after = engine.generate([prompt], params)[0]
        tokens = before.tokens[:1]
        from tests.actors.test_engine import full_logprobs

        assert engine.version == 1
        assert abs(full_logprobs(engine, prompt, tokens)[0] - before.logprobs[0]) > 1e-3
        assert after.logprobs != before.logprobs
    finally:
        subscriber.close()
        publisher.close()


def test_late_joiner_asks_for_the_current_adapter(tiny_model):
    engine = TorchEngine(tiny_model, LORA)
    publisher = WeightPublisher()
    try:
        publisher.publish(random_adapter(engine, version=5))
        late = WeightSubscriber(publisher.endpoints)  # missed the PUB message
        assert late.poll() is None
        current = late.latest(timeout=10)
        assert current is not None and current.version == 5
        late.close()
    finally:
        publisher.close()


def test_actor_applies_new_adapters_between_turns_and_records_versions(tiny_model, chat):
    engine = TorchEngine(tiny_model, LORA)
    buffer = ReplayBuffer(groups_per_step=2, max_staleness=100)
    replay = LocalReplay(buffer, actor="actor-0")
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoints)
    cfg = ActorConfig(group_size=2, groups_in_flight=2, max_new_tokens=4)
    actor = Actor(cfg, "actor-0", engine, chat, lambda: make_env("maze", max_steps=6), replay, subscriber)
    stop = threading.Event()
    thread = threading.Thread(target=actor.run, args=(stop,))
    try:
        publisher.publish(random_adapter(engine, version=0, scale=0.0))
        thread.start()
        deadline = time.time() + 120
        version = 0
        while time.time() < deadline and len(buffer.queue) < 12:
            version += 1
            buffer.set_version(version)
            publisher.publish(random_adapter(engine, version=version, seed=version))
            time.sleep(0.3)
    finally:
        stop.set()
        thread.join(60)
        subscriber.close()
        publisher.close()
    groups = [decode_group(e.blob) for e in buffer.queue]
    assert len(groups) >= 12
    for g in groups:
        assert len(g.trajectories) == 2 and len({t.tokens[:20].tobytes() for t in g.trajectories}) == 1
        for t in g.trajectories:
            assert t.mask.sum() > 0 and t.finish_reason in ("terminated", "truncated")
            assert (t.logprobs[t.mask == 0] == 0).all() and (t.logprobs[t.mask == 1] <= 0).all()
    # each episode samples from a stream of its own: a group's episodes play one task differently
    assert any(len({t.tokens.tobytes() for t in g.trajectories}) > 1 for g in groups)
    versions = {int(v) for g in groups for t in g.trajectories for v in t.versions[t.mask == 1]}
    assert len(versions) > 1 and max(versions) > 0, "the actor never applied a new adapter"
    assert actor.stats()["adapters_applied"] >= 1


def test_evaluation_greedy_or_sampled_k_times_a_task_with_common_random_numbers(tiny_model, chat):
    from actors.rollout import evaluate

    env = make_env("maze")
    tasks = env.eval_tasks(env.eval_seed, 3)

    def run(**kw):
        engine = TorchEngine(tiny_model, LORA, seed=5)
        try:
            return evaluate(engine, chat, lambda: make_env("maze"), tasks, 4, 512, **kw)
        finally:
            engine.close()

    greedy = run()
    assert greedy["episodes"] == 3 and run() == greedy
    sampled = run(temperature=1.0, samples=4)
    assert sampled["episodes"] == 12
    assert run(temperature=1.0, samples=4) == sampled  # a fresh engine with the same seed plays the same episodes
    for wave in (1, 5):  # played in waves of any size (a batch engine's evaluation), the same episodes
        assert run(temperature=1.0, samples=4, wave=wave) == sampled
    for bad in ({"samples": 0}, {"samples": 2}, {"temperature": -1.0}):  # several greedy plays are one play
        with pytest.raises(ValueError, match="samples"):
            run(**bad)
    with pytest.raises(ValueError, match="wave must be at least 1"):
        run(wave=0)


def test_an_episode_samples_the_same_tokens_whichever_episodes_share_its_turns(tiny_model, chat):
    """A slow environment step makes its episode sit turns out, so the other episodes are sampled
    in other batches than when every step is fast; each episode samples from its own seeded
    stream, so no episode's tokens change (a shared random stream made the evaluation above
    depend on thread timing)."""
    from actors.envrunner import EnvRunner
    from actors.rollout import play, start
    from tests.actors.test_isolation import Echo

    def run(slow_s):
        engine = TorchEngine(tiny_model, LORA, seed=5)
        batches, generate = [], engine.generate

        def spy(prompts, params, sessions=None, seeds=None):
            batches.append(list(sessions))
            return generate(prompts, params, sessions=sessions, seeds=seeds)

        engine.generate = spy
        runner = EnvRunner(threads=4)
        try:
            episodes = [start(Echo(delay_s=slow_s if i == 0 else 0.0, turns=3), chat, runner, sampling_seed=i)
                        for i in range(4)]
            play(engine, chat, episodes, SamplingParams(6, chat.stop_ids, temperature=1.0), 512, runner)
        finally:
            runner.close()
        slow = episodes[0].session
        return [e.tokens for e in episodes], [b for b in batches if slow not in b and len(b) > 1]

    together, _ = run(0.0)
    apart, without_slow = run(0.5)
    assert without_slow, "the slow episode never sat a turn out"
    assert apart == together


def test_turns_are_seeded_except_with_vllm_on_a_gpu_unless_asked(tiny_model, chat):
    from actors.actor import seeds_requests

    assert seeds_requests("auto", vllm_on_gpu=False) and not seeds_requests("auto", vllm_on_gpu=True)
    assert seeds_requests("on", vllm_on_gpu=True) and not seeds_requests("off", vllm_on_gpu=False)
    with pytest.raises(ValueError, match="--actor.seeded must be auto, on or off, got 'sometimes'"):
        seeds_requests("sometimes", vllm_on_gpu=False)
    with pytest.raises(ValueError, match="--actor.seeded"):
        ActorConfig(seeded="sometimes")
    engine = TorchEngine(tiny_model, LORA)
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoints)
    try:
        for choice, seeded in (("auto", True), ("off", False)):  # the torch engine on this CPU
            actor = Actor(ActorConfig(group_size=2, seeded=choice), "actor-0", engine, chat,
                          lambda: make_env("maze"), LocalReplay(ReplayBuffer(groups_per_step=2, max_staleness=100), actor="actor-0"), subscriber)
            try:
                episodes = actor._start_group().episodes
                assert [e.sampling_seed is not None for e in episodes] == [seeded, seeded]
            finally:
                actor.runner.close()
    finally:
        subscriber.close()
        publisher.close()


def test_an_actor_lends_its_engine_between_its_groups_and_plays_on(tiny_model, chat):
    """The run's evaluation borrows an actor's engine when actors have GPUs (launch/evaluators.py):
    the loan runs in the actor's own thread once every group it started has been pushed, with the
    adapter it carries, and scores what a fresh engine with that adapter scores; then the actor
    plays on. An actor that has stopped lends nothing."""
    from actors.rollout import evaluate

    engine = TorchEngine(tiny_model, LORA)
    buffer = ReplayBuffer(groups_per_step=2, max_staleness=100)
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoints)
    actor = Actor(ActorConfig(group_size=2, groups_in_flight=2, max_new_tokens=4), "actor-0", engine, chat,
                  lambda: make_env("maze", max_steps=6), LocalReplay(buffer, actor="actor-0"), subscriber)
    counts = {"started": 0, "pushed": 0}
    start_group, push = actor._start_group, actor._push

    def started():
        counts["started"] += 1
        return start_group()

    def pushed(g):
        push(g)
        counts["pushed"] += 1

    actor._start_group, actor._push = started, pushed
    env = make_env("maze")
    tasks = env.eval_tasks(env.eval_seed, 4)
    adapter = random_adapter(engine, version=3, seed=7)
    seen = {}

    def play(lent):
        seen.update(thread=threading.current_thread(), counts=dict(counts))
        return lent.version, evaluate(lent, chat, lambda: make_env("maze"), tasks, 4, 512)

    stop = threading.Event()
    thread = threading.Thread(target=actor.run, args=(stop,))
    try:
        publisher.publish(random_adapter(engine, version=0, scale=0.0))
        thread.start()
        deadline = time.time() + 120
        while time.time() < deadline and counts["pushed"] < 2:  # it is playing
            time.sleep(0.05)
        version, borrowed = actor.lend(play, adapter, timeout=120)
        after = counts["pushed"]
        while time.time() < deadline and counts["pushed"] < after + 2:  # and it plays on
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(60)
        subscriber.close()
        publisher.close()
    assert seen["thread"] is thread and seen["counts"]["started"] == seen["counts"]["pushed"] >= 2, seen
    assert version == engine.version == 3 and counts["pushed"] >= after + 2
    fresh = TorchEngine(tiny_model, LORA)
    fresh.load_adapter(3, adapter.tensors)
    assert borrowed == evaluate(fresh, chat, lambda: make_env("maze"), tasks, 4, 512)
    with pytest.raises(RuntimeError, match="actor-0 has stopped: it has no engine to lend"):
        actor.lend(play)


def test_a_group_with_a_greedy_play_holds_the_episode_evaluation_would_play(tiny_model, chat):
    """Run as a user would with --actor.greedy-play: the first episode of every group pushed is the
    greedy play of the group's maze, token for token (what evaluation plays), with each token's
    log-prob at the sampling temperature, and the other episodes are sampled."""
    from actors.envrunner import EnvRunner
    from actors.rollout import play, start

    engine = TorchEngine(tiny_model, LORA, seed=5)
    cfg = ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=6, temperature=0.7, greedy_play=True)
    groups, stats = play_groups(engine, chat, cfg, lambda: make_env("maze"), max_groups=4, seed=3)
    assert len(groups) == 4 and all(g.meta[GREEDY_PLAYS] == 1.0 for g in groups)
    assert stats["greedy_plays"] == 4
    assert stats["greedy_outcome_sum"] == pytest.approx(sum(g.trajectories[0].reward for g in groups))
    runner = EnvRunner(threads=2)
    try:
        for g in groups:
            seed = int(g.task.removeprefix("seed="))
            ep = start(make_env("maze"), chat, runner, seed=seed, options={"policy_version": 0})
            play(engine, chat, [ep], SamplingParams(6, chat.stop_ids, temperature=0.0), cfg.max_tokens, runner)
            first, *sampled = g.trajectories
            assert first.tokens.tolist() == ep.tokens and first.reward == ep.reward
            moves = first.mask.astype(bool)
            assert (first.logprobs[moves] < 0).all(), "log-probs at 0.7, not of a distribution made one-hot"
            assert any(t.tokens.tolist() != ep.tokens for t in sampled)
    finally:
        runner.close()
    with pytest.raises(ValueError, match="needs the torch engine"):
        ActorConfig(engine="vllm", greedy_play=True)
