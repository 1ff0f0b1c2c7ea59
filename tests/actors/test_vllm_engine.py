"""The vLLM engine, run as a user would run it: vLLM's CPU build here (`.[test]` installs it),
its GPU build where there is a GPU. One engine serves the whole module (engines take
20-70 s to start); the last test shuts it down and checks that nothing is left running."""

import os
import threading
import time

import pytest
import torch

from actors.engine import RequestEngine, SamplingParams
from actors.engines import make_engine
from actors.torch_engine import TorchEngine
from bench.parity import compare, learner_logprobs, prompts_for, random_adapter
from policy.load import LoraSpec

pytestmark = pytest.mark.slow  # a vLLM engine (its CPU build) starts for this module: `pytest -m slow`

pytest.importorskip("vllm", reason="the vLLM engine tests need vLLM: pip install -e '.[test]'")

LORA = LoraSpec(rank=8)
CUDA = torch.cuda.is_available()
DTYPE = "bfloat16" if CUDA else "float32"  # vLLM's LoRA kernels on GPUs take 16-bit types only
TOLERANCE = {"float32": (5e-4, 1e-8), "bfloat16": (0.5, 1e-2)}[DTYPE]
"""(max |log μ − log π|, mismatch KL) against the learner's float32 scoring."""


@pytest.fixture(scope="module")
def engine(tiny_model):
    # On CUDA vLLM is batch-invariant only in its batch-invariant mode (vLLM issue 19491), which the
    # seeded-determinism tests below need there; its engine process reads the flag when it starts.
    before = os.environ.get("VLLM_BATCH_INVARIANT")
    if CUDA:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    try:
        engine = make_engine("vllm", tiny_model, LORA, device="auto", dtype=DTYPE, max_model_len=1024)
    finally:
        if before is None:
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
        else:
            os.environ["VLLM_BATCH_INVARIANT"] = before
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return [random_adapter(tiny_model, LORA, seed=s) for s in range(4)]


def test_starts_and_samples_with_logprobs_one_request_per_turn(engine, chat):
    assert isinstance(engine, RequestEngine)
    prompts = prompts_for(chat, 6)
    params = SamplingParams(12, chat.stop_ids, temperature=0.7)
    for i, p in enumerate(prompts):
        engine.submit(("turn", i), p, params)
    done = {}
    while len(done) < len(prompts):
        done.update(engine.collect(timeout=1.0))
    assert engine.pending == 0
    for out in done.values():
        assert 1 <= len(out.tokens) <= 12
        assert len(out.logprobs) == len(out.tokens) == len(out.versions)
        assert all(lp <= 0 for lp in out.logprobs)
        assert out.stopped == (out.tokens[-1] in chat.stop_ids)
        assert set(out.versions) == {engine.version}
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit(("turn", "empty"), [], params)


def test_a_colocated_rank_gives_vllm_its_adapter_each_step_and_trains_strictly_on_policy(engine, tiny_model, chat):
    """`--colocate --actor.engine vllm`, one learner rank in this process with the module's engine
    (before any other test loads an adapter into it): before each step the rank hands the
    engine its current adapter, plays its share of the step's groups and trains on them. Every
    token carries the version the learner trains (staleness 0); on this CPU the engine cannot
    sleep and says so (False), keeping its memory."""
    from actors.actor import ActorConfig
    from envs import make_env
    from launch.colocate import Colocated
    from learner.config import LearnerConfig
    from learner.trainer import Learner
    from replay.buffer import ReplayBuffer
    from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
    from replay.server import ReplayServer
    from tests.learner.test_fsdp import _port

    assert engine.version == 0
    server = ReplayServer(ReplayBuffer(groups_per_step=2, max_staleness=0), "tcp://127.0.0.1:*")
    endpoint = server.start()
    learner = Learner(LearnerConfig(lr=1e-2, groups_per_step=2, lora=LORA), tiny_model, 0, 1,
                      f"tcp://127.0.0.1:{_port()}", ZmqLearnerReplay(endpoint), temperature=0.7)
    try:
        learner.setup()
        actor_cfg = ActorConfig(engine="vllm", group_size=2, groups_in_flight=2, max_new_tokens=4)
        colocated = Colocated(learner, actor_cfg, chat, lambda: make_env("maze", max_steps=3),
                              ZmqActorReplay(endpoint, actor="learner-0"), share=2, engine=engine)
        assert not colocated.own_model  # vLLM holds its own copy of the base weights
        learner.before_step = colocated.generate
        learner.run(3)
        metrics, stats = learner.drain_metrics(), colocated.stats()
    finally:
        learner.close()
        server.stop()
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["staleness_max"] == 0.0 and m["generate_s"] > 0 for m in metrics)
    assert stats["groups"] == 6 and server.buffer.snapshot()["received_groups"] == 6
    assert engine.version == 2 and engine.stats["adapters_loaded"] == 2  # v1 before step 2, v2 before step 3
    assert not engine.sleep_mode and engine.sleep() is False and not engine.asleep
    assert engine.pending == 0


def test_greedy_stops_on_a_stop_token_and_is_deterministic(engine, chat):
    prompt = prompts_for(chat, 1)[0]
    a = engine.generate([prompt], SamplingParams(6, chat.stop_ids, temperature=0.0))[0]
    b = engine.generate([prompt], SamplingParams(6, chat.stop_ids, temperature=0.0))[0]
    assert a.tokens == b.tokens
    stop = a.tokens[0]
    c = engine.generate([prompt], SamplingParams(6, (stop,), temperature=0.0))[0]
    assert c.tokens == [stop] and c.stopped


def test_a_seeded_request_samples_the_same_tokens_whatever_runs_beside_it(engine, chat):
    """A seeded turn's tokens are a function of (engine seed, request seed, prompt, adapter),
    not of the requests vLLM batches with it: the same alone, first or last in a crowd of
    seeded and unseeded requests (the unseeded ones draw from vLLM's shared generator), and
    joining a crowd that has been sampling for a while. Log-probs agree to float tolerance (a
    batch of another shape may sum in another order). Another seed samples other tokens: at
    temperature 1 with no stop token, 32 tokens of a near-uniform tiny model do not collide."""
    params, long = SamplingParams(32, (), temperature=1.0), SamplingParams(200, (), temperature=1.0)
    prompts = prompts_for(chat, 6)
    target, seed = prompts[0], 1234
    alone = engine.generate([target], params, seeds=[seed])[0]
    assert len(alone.tokens) == 32
    # (prompt, params, seed): the target's prompt under another seed is others[3].
    others = [(prompts[1], params, None), (prompts[2], long, 7), (prompts[3], params, None),
              (target, params, seed + 1), (prompts[4], long, None), (prompts[5], params, 8)]

    def crowd(tag, order, target_at, join_late=False):
        """Submit `others` in `order`, the target at position `target_at`; with `join_late`, the
        target only once every request before it has sampled a few tokens."""
        subs = [((tag, i), *others[i]) for i in order]
        subs.insert(target_at, ((tag, "target"), target, params, seed))
        for n, (key, prompt, p, s) in enumerate(subs):
            if join_late and key == (tag, "target"):
                while any(len(engine._turns[k].tokens) < 4 for k, *_ in subs[:n]):
                    time.sleep(0.01)
            engine.submit(key, prompt, p, s)
        done = {}
        while len(done) < len(subs):
            done.update(engine.collect(timeout=1.0))
        return done

    atol = {"float32": 1e-4, "bfloat16": 5e-2}[DTYPE]
    runs = {"first": crowd("first", [0, 1, 2, 3, 4, 5], 0),
            "last": crowd("last", [5, 4, 3, 2, 1, 0], 6),
            "joins": crowd("joins", [4, 1, 3, 0, 5, 2], 6, join_late=True)}
    for tag, done in runs.items():
        out = done[(tag, "target")]
        assert out.tokens == alone.tokens, f"target {tag}: its tokens changed with the requests beside it"
        torch.testing.assert_close(out.logprobs, alone.logprobs, atol=atol, rtol=0)
        assert done[(tag, 3)].tokens != alone.tokens, "another seed sampled the same tokens"
    assert engine.generate([target], params, seeds=[seed + 1])[0].tokens == runs["first"][("first", 3)].tokens


def test_seeded_requests_whose_prompts_exceed_a_step_complete(engine, chat):
    """Many long seeded prompts at once, more tokens than one engine step takes: on a CPU vLLM
    would split a prefill across steps and then rewind the request's generator, which a CPU
    generator cannot do (the engine died with "CPU Generator does not use offset" in a run
    with several actors); every request completes, and seeded ones as they would alone."""
    import random

    rng = random.Random(0)
    vocab = [t for t in range(len(chat.tokenizer)) if t not in chat.stop_ids]
    prompts = [[rng.choice(vocab) for _ in range(1000)] for _ in range(8)]  # 8,000 distinct tokens
    params = SamplingParams(8, chat.stop_ids, temperature=1.0)
    for i, p in enumerate(prompts):
        engine.submit(("long", i), p, params, seed=i)
    done = {}
    deadline = time.time() + 600
    while len(done) < len(prompts):
        assert time.time() < deadline, f"{len(done)} of {len(prompts)} long requests came back"
        done.update(engine.collect(timeout=1.0))
    engine.submit(("alone", 3), prompts[3], params, seed=3)
    alone = {}
    while not alone:
        alone.update(engine.collect(timeout=1.0))
    assert alone[("alone", 3)].tokens == done[("long", 3)].tokens


def test_logprobs_agree_with_the_learners_scoring_of_the_same_tokens(engine, tiny_model, chat, adapters):
    """Parity: μ recorded by vLLM and π scored by the learner, same adapter, same temperature.
    In float32 (vLLM's CPU build) they agree to about 1e-5; the torch engine is held to the
    float32 standard beside it."""
    params = SamplingParams(12, chat.stop_ids, temperature=0.7)
    prompts = prompts_for(chat, 8)
    _load_next(engine, adapters[0])
    vllm = compare(engine, tiny_model, LORA, adapters[0], prompts, params)
    ref = compare(TorchEngine(tiny_model, LORA, seed=0), tiny_model, LORA, adapters[0], prompts, params)
    assert vllm["tokens"] >= len(prompts) and ref["tokens"] >= len(prompts)
    assert vllm["max_abs"] < TOLERANCE[0] and vllm["kl"] < TOLERANCE[1], vllm
    assert ref["max_abs"] < 5e-4 and ref["kl"] < 1e-8, ref
    # The adapter matters: the same tokens scored without it differ by far more than that.
    zero = {k: torch.zeros_like(v) for k, v in adapters[0].items()}
    seqs = [p + toks for p, toks, _ in vllm["sequences"]]
    bare = learner_logprobs(tiny_model, LORA, zero, seqs, params.temperature)
    gap = max(abs(mu - bare_s[len(p) + j]) for (p, _, lps), bare_s in zip(vllm["sequences"], bare)
              for j, mu in enumerate(lps))
    assert gap > 1e-2, "vLLM sampled as if no adapter were applied"


def _load_next(engine, tensors):
    engine.load_adapter(engine.version + 1, tensors)
    return engine.version


@pytest.mark.parametrize("mode", ["finish", "cut"])
def test_an_adapter_arriving_mid_request_is_recorded_token_by_token(engine, chat, adapters, mode):
    """Long requests are running when a new adapter arrives. "finish": they end under the old
    version and new requests use the new one; "cut": they continue under the new one, and the
    versions change exactly where the cut fell."""
    engine.in_flight = mode
    old = _load_next(engine, adapters[1])
    params = SamplingParams(800, (), temperature=1.0)  # no stop token: long requests
    prompts = prompts_for(chat, 4)
    for i, p in enumerate(prompts):
        engine.submit((mode, i), p, params)
    while any(len(engine._turns[(mode, i)].tokens) < 4 for i in range(len(prompts))):
        time.sleep(0.01)  # every request has sampled a few tokens under the old adapter
    new = _load_next(engine, adapters[2])
    engine.submit((mode, "after"), prompts[0], SamplingParams(8, (), temperature=1.0))
    done = {}
    while len(done) < len(prompts) + 1:
        done.update(engine.collect(timeout=1.0))
    assert set(done[(mode, "after")].versions) == {new}
    for i in range(len(prompts)):
        out = done[(mode, i)]
        assert len(out.tokens) == len(out.versions) == len(out.logprobs) == 800
        assert out.versions == sorted(out.versions), "versions never go back within a turn"
        if mode == "finish":
            assert set(out.versions) == {old}
        else:
            assert out.versions[0] == old
            assert set(out.versions) <= {old, new}
    if mode == "cut":
        assert any(new in done[(mode, i)].versions for i in range(len(prompts))), "no request was cut"
    engine.in_flight = "finish"


def test_a_malformed_or_oversized_adapter_is_refused_and_the_engine_goes_on(engine, chat, adapters):
    good = adapters[3]
    before = engine.version
    missing_b = {k: v for k, v in good.items() if ".lora_B." not in k}
    with pytest.raises(ValueError, match="does not fit the model"):
        engine.load_adapter(before + 1, missing_b)
    too_big = {k: (torch.zeros(64, v.shape[1]) if ".lora_A." in k else torch.zeros(v.shape[0], 64))
               for k, v in good.items()}
    with pytest.raises(ValueError, match="rank 64, above"):
        engine.load_adapter(before + 1, too_big)
    wrong_shape = {k: (v[:, :-3] if ".lora_A." in k else v) for k, v in good.items()}
    with pytest.raises(ValueError, match="has shape"):  # vLLM itself would copy what fits
        engine.load_adapter(before + 1, wrong_shape)
    renamed = {k.replace("q_proj", "qq_proj"): v for k, v in good.items()}
    with pytest.raises(ValueError, match="does not fit the model"):
        engine.load_adapter(before + 1, renamed)
    with pytest.raises(ValueError, match="not newer"):
        engine.load_adapter(before, good)
    assert engine.version == before
    out = engine.generate(prompts_for(chat, 2), SamplingParams(4, chat.stop_ids, temperature=0.7))
    assert all(set(o.versions) == {before} for o in out)
    engine.load_adapter(before + 1, good)
    assert engine.version == before + 1


def test_an_actor_plays_with_vllm_and_records_the_version_of_every_token(engine, tiny_model, chat):
    """The actor's loop on the vLLM engine: one request per episode turn, adapters arriving over
    the real weight channel while episodes run, every group complete and consistent."""
    from actors.actor import Actor, ActorConfig
    from envs import make_env
    from replay.buffer import ReplayBuffer
    from replay.client import LocalReplay
    from policy.adapter import Adapter
    from weights.publisher import WeightPublisher
    from weights.subscriber import WeightSubscriber
    from replay.wire import decode_group

    base = engine.version
    buffer = ReplayBuffer(groups_per_step=2, max_staleness=100)
    replay = LocalReplay(buffer, actor="actor-0")
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(publisher.endpoints)
    cfg = ActorConfig(engine="vllm", group_size=2, groups_in_flight=3, max_new_tokens=4)
    actor = Actor(cfg, "actor-0", engine, chat, lambda: make_env("maze", max_steps=6), replay, subscriber)
    stop = threading.Event()
    thread = threading.Thread(target=actor.run, args=(stop,))
    try:
        thread.start()
        deadline, version = time.time() + 240, base
        while time.time() < deadline and len(buffer.queue) < 10:
            version += 1
            buffer.set_version(version - base)
            publisher.publish(Adapter(version, tiny_model, LORA.to_dict(),
                                      random_adapter(tiny_model, LORA, seed=version, scale=0.05)))
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join(120)
        subscriber.close()
        publisher.close()
    assert not thread.is_alive()
    groups = [decode_group(e.blob) for e in buffer.queue]
    assert len(groups) >= 10
    for g in groups:
        assert len(g.trajectories) == 2 and len({t.tokens[:20].tobytes() for t in g.trajectories}) == 1
        for t in g.trajectories:
            assert t.mask.sum() > 0 and t.finish_reason in ("terminated", "truncated")
            assert (t.logprobs[t.mask == 0] == 0).all() and (t.logprobs[t.mask == 1] <= 0).all()
            model = t.versions[t.mask == 1]
            assert (model[1:] >= model[:-1]).all(), "versions never go back within an episode"
    versions = {int(v) for g in groups for t in g.trajectories for v in t.versions[t.mask == 1]}
    assert len(versions) > 1 and max(versions) > base + 1, "the actor never applied a new adapter"
    assert engine.pending == 0


def test_shutdown_leaves_no_process_behind(engine, chat):
    import psutil

    procs = engine.processes()
    assert procs, "vLLM's engine runs in processes of its own"
    engine.submit(("shutdown", 0), prompts_for(chat, 1)[0], SamplingParams(500, (), temperature=1.0))
    engine.close()  # with a request still running
    assert not [(p.pid, p.cmdline()) for p in procs if _alive(p)]
    assert not [d for d in (engine._files.fast, engine._files.slow) if d is not None and d.exists()]


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.gpu
def test_on_a_gpu_the_engine_sleeps_while_a_learner_trains_and_wakes_as_it_was(tiny_model, chat):
    """Colocated vLLM on a GPU: asleep, the engine gives back its KV cache and weights' GPU
    memory; awake, with the adapter it had, it samples the same greedy tokens as before."""
    engine = make_engine("vllm", tiny_model, LORA, device="cuda", dtype=DTYPE, max_model_len=1024,
                         memory_fraction=0.3, sleep_mode=True)
    try:
        assert engine.sleep_mode
        engine.load_adapter(1, random_adapter(tiny_model, LORA, seed=1))
        prompts, params = prompts_for(chat, 4), SamplingParams(8, chat.stop_ids, temperature=0.0)
        before = engine.generate(prompts, params)
        free = torch.cuda.mem_get_info()[0]
        assert engine.sleep() and engine.asleep
        assert torch.cuda.mem_get_info()[0] > free + (1 << 30)  # at least the KV cache came back
        engine.wake()
        assert not engine.asleep
        assert [c.tokens for c in engine.generate(prompts, params)] == [c.tokens for c in before]
    finally:
        engine.close()
