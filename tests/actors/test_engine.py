"""The torch engine: batched multi-turn generation whose log-probs match a plain forward."""

import pytest
import torch

from actors.engine import SamplingParams
from actors.engines import make_engine
from actors.torch_engine import TorchEngine
from policy.load import LoraSpec


def full_logprobs(engine, prompt, generated):
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + generated])).logits[0]
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(generated)]


def _probe_logits(engine):
    with torch.no_grad():
        return engine.model(input_ids=torch.arange(1, 9)[None]).logits


def perturbed_engine(tiny_model, seed=1):
    """An engine whose adapter is not the identity: a random lora_B (PEFT starts it at zero),
    applied through `load_adapter`, as actors apply adapters from the weight channel (the engine
    merges the adapter into its weights, so writing into the LoRA parameters would change
    nothing). Asserts that the model now computes something else."""
    from peft import get_peft_model_state_dict

    engine = TorchEngine(tiny_model, LoraSpec(rank=4), seed=seed)
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v.clone()
               for k, v in get_peft_model_state_dict(engine.model).items()}
    bare = _probe_logits(engine)
    engine.load_adapter(1, tensors)
    assert (_probe_logits(engine) - bare).abs().max() > 1e-3, "the perturbation left the model as it was"
    return engine


def test_the_perturbed_engine_samples_from_the_adapted_model_not_the_bare_one(tiny_model, chat):
    """The tests below check the engine on a perturbed adapter; this one checks that the
    perturbation reaches the log-probs the engine records."""
    engine, bare = perturbed_engine(tiny_model), TorchEngine(tiny_model, LoraSpec(rank=4))
    prompt = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    out = engine.generate([prompt], SamplingParams(6, chat.stop_ids, temperature=1.0), seeds=[0])[0]
    torch.testing.assert_close(out.logprobs, full_logprobs(engine, prompt, out.tokens), atol=1e-4, rtol=0)
    assert max(abs(a - b) for a, b in zip(out.logprobs, full_logprobs(bare, prompt, out.tokens))) > 1e-2


def test_logprobs_match_a_full_forward_across_turns_and_batch_changes(tiny_model, chat):
    engine = perturbed_engine(tiny_model)
    params = SamplingParams(4, chat.stop_ids, temperature=1.0)
    a = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    b = chat.prompt_ids([{"role": "user", "content": "a longer opening message"}])
    first = engine.generate([a, b], params, sessions=["a", "b"])
    a2 = a + first[0].tokens + chat.observation_ids([{"role": "user", "content": "moved"}])
    c = chat.prompt_ids([{"role": "user", "content": "late joiner"}])
    # b finished, c joins, order changes: the cache is reused, not rebuilt
    second = engine.generate([c, a2], params, sessions=["c", "a"])
    for prompt, out in [(a, first[0]), (b, first[1]), (c, second[0]), (a2, second[1])]:
        torch.testing.assert_close(out.logprobs, full_logprobs(engine, prompt, out.tokens), atol=1e-4, rtol=0)


def test_greedy_is_deterministic_and_stops_on_the_stop_token(tiny_model, chat):
    engine = perturbed_engine(tiny_model)
    prompt = chat.prompt_ids([{"role": "user", "content": "hello"}])
    out1 = engine.generate([prompt], SamplingParams(6, chat.stop_ids, temperature=0.0))
    out2 = engine.generate([prompt], SamplingParams(6, chat.stop_ids, temperature=0.0))
    assert out1[0].tokens == out2[0].tokens
    stop = out1[0].tokens[0]
    out3 = engine.generate([prompt], SamplingParams(6, (stop,), temperature=0.0))
    assert out3[0].tokens == [stop] and out3[0].stopped


def test_a_seeded_request_samples_the_same_tokens_in_any_batch(tiny_model, chat):
    """Which episodes share a turn, and in which order, depends on timing (an environment call
    may make an episode sit a turn out); a seeded request's tokens must not: they are a function
    of (engine seed, request seed, prompt) only."""
    params = SamplingParams(8, chat.stop_ids, temperature=1.0)
    texts = ["start\n@.#\n#.G", "hello", "a longer opening message", "late joiner", "hello"]
    prompts = [chat.prompt_ids([{"role": "user", "content": t}]) for t in texts]
    engine = perturbed_engine(tiny_model)
    alone = [engine.generate([p], params, seeds=[s])[0] for s, p in enumerate(prompts)]
    batches = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0], [3, 1, 4]]
    for rows in batches:  # new sessions each time, so the cache is rebuilt or grown, never shared
        outs = engine.generate([prompts[i] for i in rows], params, sessions=[(tuple(rows), i) for i in rows],
                               seeds=rows)
        for i, out in zip(rows, outs):
            assert out.tokens == alone[i].tokens, (rows, i)
            torch.testing.assert_close(out.logprobs, alone[i].logprobs, atol=1e-4, rtol=0)
    # The seed is what decides: the same prompt under another seed, or in another engine seed,
    # samples other tokens (prompts 1 and 4 are the same text).
    assert alone[1].tokens != alone[4].tokens
    other = perturbed_engine(tiny_model, seed=2)
    assert [o.tokens for o in other.generate(prompts, params, seeds=list(range(5)))] != [a.tokens for a in alone]


def test_sampling_follows_the_distribution_it_records(tiny_model, chat):
    """Inverse-CDF sampling from hashed uniforms draws every token of the vocabulary with the
    probability the model gives it (temperature 0.7): over many request seeds, each token's
    frequency is within 4 standard errors of its probability, and a sampled token's recorded
    log-prob is log of that probability."""
    engine = perturbed_engine(tiny_model)
    prompt = chat.prompt_ids([{"role": "user", "content": "hello"}])
    n = 2000
    outs = engine.generate([prompt] * n, SamplingParams(1, chat.stop_ids, temperature=0.7), seeds=list(range(n)))
    with torch.no_grad():
        probs = torch.softmax(engine.model(input_ids=torch.tensor([prompt])).logits[0, -1] / 0.7, -1)  # [V]
    freq = torch.bincount(torch.tensor([o.tokens[0] for o in outs]), minlength=len(probs)) / n  # [V]
    bound = 4 * (probs * (1 - probs) / n).sqrt() + 2 / n
    assert ((freq - probs).abs() <= bound).all(), (freq - probs).abs().max()
    assert (freq > 0).sum() > 1
    for o in outs[:50]:
        assert abs(o.logprobs[0] - probs[o.tokens[0]].log().item()) < 1e-4


def test_greedy_rows_in_a_sampled_batch_take_the_argmax_and_its_sampled_log_prob(tiny_model, chat):
    """--actor.greedy-play: rows flagged greedy inside a batch sampled at 0.7 write what a greedy
    call writes, token for token, and record each token's log-prob at 0.7, as the learner scores
    it; the rows beside them are sampled as they would be without the flags."""
    engine = perturbed_engine(tiny_model)
    params = SamplingParams(6, chat.stop_ids, temperature=0.7)
    prompts = [chat.prompt_ids([{"role": "user", "content": t}]) for t in ["hello", "start\n@.#\n#.G", "hello"]]
    greedy = [engine.generate([p], SamplingParams(6, chat.stop_ids, temperature=0.0))[0] for p in prompts]
    plain = engine.generate(prompts, params, sessions=["p0", "p1", "p2"], seeds=[0, 1, 2])
    mixed = engine.generate(prompts, params, sessions=["m0", "m1", "m2"], seeds=[0, 1, 2],
                            greedy=[True, False, True])
    for i in (0, 2):
        assert mixed[i].tokens == greedy[i].tokens
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompts[i] + mixed[i].tokens])).logits[0]
        logp = torch.log_softmax(logits / 0.7, -1)
        want = [logp[len(prompts[i]) - 1 + j, t].item() for j, t in enumerate(mixed[i].tokens)]
        torch.testing.assert_close(mixed[i].logprobs, want, atol=1e-4, rtol=0)
    assert mixed[1].tokens == plain[1].tokens
    assert plain[0].tokens != greedy[0].tokens or plain[2].tokens != greedy[2].tokens, \
        "the sampled rows happened to write the greedy replies: the test cannot tell them apart"
    with pytest.raises(ValueError, match="one greedy flag per prompt"):
        engine.generate(prompts, params, greedy=[True])


def test_unknown_engine_is_a_clear_error(tiny_model):
    import pytest

    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tensorrt", tiny_model, LoraSpec())


def _fed_widths(engine):
    """Record how many tokens each forward pass feeds (instrumentation, not a replacement)."""
    widths, forward = [], engine.model.forward

    def spy(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    engine.model.forward = spy
    return widths


def test_compacting_the_cache_keeps_logprobs_exact(tiny_model, chat):
    engine = perturbed_engine(tiny_model)
    params = SamplingParams(3, chat.stop_ids, temperature=1.0)
    long = chat.prompt_ids([{"role": "user", "content": "x" * 150}])
    short = chat.prompt_ids([{"role": "user", "content": "hi"}])
    first = engine.generate([long, short], params, sessions=["long", "short"])
    width, cache = engine._mask.shape[1], engine._cache
    # "long" ends and a new long episode joins: "short" keeps a real row of ~11 slots in a
    # ~160-slot axis, which is compacted before the newcomer's tokens are appended
    late = chat.prompt_ids([{"role": "user", "content": "y" * 150}])
    short2 = short + first[1].tokens + chat.observation_ids([{"role": "user", "content": "ok"}])
    second = engine.generate([short2, late], params, sessions=["short", "late"])
    assert engine._cache is cache  # the same cache object: nothing was re-prefilled
    assert engine._mask.shape[1] < width + len(late) - 100  # the holes are gone
    short3 = short2 + second[0].tokens + chat.observation_ids([{"role": "user", "content": "go"}])
    third = engine.generate([short3, late + second[1].tokens], params, sessions=["short", "late"])
    for prompt, out in [(short2, second[0]), (late, second[1]), (short3, third[0]),
                        (late + second[1].tokens, third[1])]:
        torch.testing.assert_close(out.logprobs, full_logprobs(engine, prompt, out.tokens), atol=1e-4, rtol=0)


def _new_adapter(engine, scale=0.2):
    from peft import get_peft_model_state_dict

    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen) * scale for k, v in get_peft_model_state_dict(engine.model).items()}


def test_a_new_adapter_keeps_the_cache_or_recomputes_it(tiny_model, chat):
    params = SamplingParams(3, chat.stop_ids, temperature=1.0)
    prompt = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    obs = chat.observation_ids([{"role": "user", "content": "moved"}])
    for recompute in (False, True):
        engine = TorchEngine(tiny_model, LoraSpec(rank=4), seed=1, recompute_kv=recompute)
        first = engine.generate([prompt], params, sessions=["a"])
        engine.load_adapter(1, _new_adapter(engine))
        widths = _fed_widths(engine)
        turn2 = prompt + first[0].tokens + obs
        second = engine.generate([turn2], params, sessions=["a"])[0]
        if recompute:  # everything re-prefilled under the new weights: exactly π_new
            assert widths[0] == len(turn2)
            torch.testing.assert_close(second.logprobs, full_logprobs(engine, turn2, second.tokens),
                                       atol=1e-4, rtol=0)
        else:  # in-flight: only the observation is fed; the prefix keeps its old keys and values
            assert widths[0] == len(obs) + 1  # (+ the last sampled token, not fed until now)
            exact = full_logprobs(engine, turn2, second.tokens)
            assert max(abs(a - b) for a, b in zip(second.logprobs, exact)) > 1e-4


def test_a_merged_adapter_computes_what_the_lora_branch_computes(tiny_model, chat):
    prompt = chat.prompt_ids([{"role": "user", "content": "start\n@.#\n#.G"}])
    params = SamplingParams(4, chat.stop_ids, temperature=0.0)
    merged = TorchEngine(tiny_model, LoraSpec(rank=4), merge_lora=True)
    branch = TorchEngine(tiny_model, LoraSpec(rank=4), merge_lora=False)
    first = _new_adapter(merged)
    for version, scale in [(1, 0.2), (2, 0.3)]:  # the second update starts again from W₀
        tensors = {k: v * scale / 0.2 for k, v in first.items()}
        for engine in (merged, branch):
            engine.load_adapter(version, tensors)
        a, b = merged.generate([prompt], params)[0], branch.generate([prompt], params)[0]
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    assert abs(a.logprobs[0] - full_logprobs(TorchEngine(tiny_model, LoraSpec(rank=4)), prompt, a.tokens)[0]) > 1e-4


def _pictured(text, image):
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image", "image": image}]}]


def _picture(seed):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)


def _full_vlm_logprobs(engine, prompt, images, generated):
    with torch.no_grad():
        pixels = engine.scheme.pixels([images])
        logits = engine.model(input_ids=torch.tensor([prompt + generated]), **pixels).logits[0]
    logits[:, list(engine.scheme.special_ids)] = float("-inf")  # never sampled: probability zero
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(generated)]


def test_image_episodes_match_a_full_forward_across_turns(tiny_vlm, vlm_chat):
    """A vision-language engine plays two image episodes for two turns (the second turn's
    picture fed into the kept KV cache): every sampled log-prob equals a plain forward over the
    whole episode with all its pictures, and no image token is ever sampled."""
    engine = TorchEngine(tiny_vlm, LoraSpec(rank=4), seed=3)
    params = SamplingParams(5, vlm_chat.stop_ids, temperature=1.0)
    pics = {"a": [_picture(0)], "b": [_picture(1)]}
    prompts = {k: vlm_chat.prompt_ids(_pictured("start", v[0])) for k, v in pics.items()}
    first = engine.generate(list(prompts.values()), params, sessions=list(prompts), seeds=[1, 2],
                            images=list(pics.values()))
    seen = []
    for (key, prompt), out in zip(prompts.items(), first):
        seen.append((prompt, list(pics[key]), out))
        pics[key].append(_picture(10 + len(seen)))
        prompts[key] = prompt + out.tokens + vlm_chat.closing(out.tokens) + vlm_chat.observation_ids(
            _pictured("moved", pics[key][-1]))
    second = engine.generate(list(prompts.values()), params, sessions=list(prompts), seeds=[3, 4],
                             images=list(pics.values()))
    for (key, prompt), out in zip(prompts.items(), second):
        seen.append((prompt, list(pics[key]), out))
    for prompt, images, out in seen:
        torch.testing.assert_close(out.logprobs, _full_vlm_logprobs(engine, prompt, images, out.tokens),
                                   atol=1e-4, rtol=0)
        assert not set(out.tokens) & set(engine.scheme.special_ids)


def test_the_picture_of_a_later_turn_reaches_the_model(tiny_vlm, vlm_chat):
    """Two episodes identical but for the picture of their second observation: the engine's
    next-token distribution differs, so later pictures are seen, not only the first."""
    engine = TorchEngine(tiny_vlm, LoraSpec(rank=4))
    params = SamplingParams(1, vlm_chat.stop_ids, temperature=0.0)
    first = _picture(0)
    opening = vlm_chat.prompt_ids(_pictured("start", first)) + [vlm_chat.stop_ids[0]]
    outs = []
    for later in (_picture(1), _picture(2)):
        prompt = opening + vlm_chat.observation_ids(_pictured("moved", later))
        outs.append(engine.generate([prompt], params, sessions=[f"s{len(outs)}"], images=[[first, later]])[0])
        assert outs[-1].logprobs[0] == pytest.approx(_full_vlm_logprobs(engine, prompt, [first, later],
                                                                       outs[-1].tokens)[0], abs=1e-4)
    with torch.no_grad():
        dists = [engine.model(input_ids=torch.tensor([opening + vlm_chat.observation_ids(_pictured("moved", p))]),
                              **engine.scheme.pixels([[first, p]])).logits[0, -1] for p in (_picture(1), _picture(2))]
    assert (dists[0] - dists[1]).abs().max() > 1e-4


def test_an_engine_refuses_image_tokens_without_their_pictures(tiny_vlm, vlm_chat):
    engine = TorchEngine(tiny_vlm, LoraSpec(rank=4))
    prompt = vlm_chat.prompt_ids(_pictured("start", _picture(0)))
    with pytest.raises(ValueError, match="without their images"):
        engine.generate([prompt], SamplingParams(2, vlm_chat.stop_ids), images=[[]])


def _full_qwen_logprobs(engine, prompt, images, generated):
    """A plain forward over the whole sequence, the model computing its own M-RoPE positions
    (get_rope_index from the token types, as the Hugging Face processor's inputs have it)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = engine.model(input_ids=ids, mm_token_type_ids=(ids == engine.scheme.image_token_id).int(),
                              **engine.scheme.pixels([images])).logits[0]
    logits[:, list(engine.scheme.special_ids)] = float("-inf")
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(generated)]


def test_qwen_image_episodes_match_a_full_forward_across_turns(qwen_vl, qwen_vl_chat):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL (M-RoPE): two image episodes play three turns in the kept KV cache,
    a third joins at the second turn and another leaves after it, pictures of two sizes; every
    sampled log-prob equals a plain forward over the whole episode with all its pictures."""
    from tests.policy.test_qwen_vl import picture

    chat = qwen_vl_chat
    engine = TorchEngine(qwen_vl, LoraSpec(rank=4), seed=3)
    params = SamplingParams(4, chat.stop_ids, temperature=1.0)
    pics = {"a": [picture(0)], "b": [picture(1, 90, 140)]}
    prompts = {k: chat.prompt_ids(_pictured("start", v[0])) for k, v in pics.items()}
    seen = []
    for turn in range(3):
        if turn == 1:
            pics["c"] = [picture(5, 140, 60)]
            prompts["c"] = chat.prompt_ids(_pictured("start", pics["c"][0]))
        if turn == 2:
            del pics["a"], prompts["a"]
        keys = list(prompts)
        outs = engine.generate([prompts[k] for k in keys], params, sessions=keys, seeds=[10 * turn + i for i in
                                                                                        range(len(keys))],
                               images=[pics[k] for k in keys])
        for key, out in zip(keys, outs):
            seen.append((prompts[key], list(pics[key]), out))
            pics[key].append(picture(20 + len(seen), *((64, 64) if len(seen) % 2 else (90, 140))))
            prompts[key] = prompts[key] + out.tokens + chat.closing(out.tokens) + chat.observation_ids(
                _pictured("moved", pics[key][-1]))
    # positions were passed to every forward: the model never computed (or cached) its own
    assert engine.model.get_base_model().model.rope_deltas is None
    for prompt, images, out in seen:
        torch.testing.assert_close(out.logprobs, _full_qwen_logprobs(engine, prompt, images, out.tokens),
                                   atol=1e-4, rtol=0)
        assert not set(out.tokens) & set(engine.scheme.special_ids)


def test_the_qwen_picture_of_a_later_turn_reaches_the_model(qwen_vl, qwen_vl_chat):
    """Two Qwen-VL episodes identical but for their second observation's picture: the engine's
    next-token distributions differ."""
    from tests.policy.test_qwen_vl import picture

    chat = qwen_vl_chat
    engine = TorchEngine(qwen_vl, LoraSpec(rank=4))
    first = picture(0)
    opening = chat.prompt_ids(_pictured("start", first)) + [chat.stop_ids[0]]
    logps = []
    for later in (picture(1), picture(2)):
        prompt = opening + chat.observation_ids(_pictured("moved", later))
        out = engine.generate([prompt], SamplingParams(1, chat.stop_ids, temperature=0.0), sessions=["s"],
                              images=[[first, later]])[0]
        assert out.logprobs[0] == pytest.approx(_full_qwen_logprobs(engine, prompt, [first, later], out.tokens)[0],
                                                abs=1e-4)
        logps.append(_full_qwen_logprobs(engine, prompt, [first, later], list(range(10, 50))))  # ordinary tokens
    assert max(abs(x - y) for x, y in zip(*logps)) > 1e-4


def _record_forwards(engine):
    """The [batch, width] of every forward the engine's model runs from now on."""
    shapes = []
    engine.model.get_base_model().register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    return shapes


def test_a_group_joining_a_running_batch_is_prefilled_once_and_apart(tiny_model, chat):
    """Two episodes are running when a group of four joins (the same opening, as a group's episodes
    have) with one more newcomer: the newcomers' prompts are prefilled in a forward of their two
    distinct prompts, the running episodes feed their observations in a forward no wider than
    those, and every log-prob of three turns equals a plain forward over the episode."""
    engine = perturbed_engine(tiny_model)
    params = SamplingParams(4, chat.stop_ids, temperature=1.0)
    prompts = {s: chat.prompt_ids([{"role": "user", "content": t}]) for s, t in [("a", "start\n@.#\n#.G"),
                                                                                ("b", "hello")]}
    seen = []

    def play(keys, seeds):
        outs = engine.generate([prompts[k] for k in keys], params, sessions=keys, seeds=seeds)
        for k, out in zip(keys, outs):
            seen.append((prompts[k], out))
            prompts[k] = prompts[k] + out.tokens + chat.closing(out.tokens) + chat.observation_ids(
                [{"role": "user", "content": "moved"}])
        return outs

    play(["a", "b"], [0, 1])
    opening = chat.prompt_ids([{"role": "user", "content": "a maze of the group " + "x" * 60}])
    prompts.update({f"g{i}": list(opening) for i in range(4)})
    prompts["c"] = chat.prompt_ids([{"role": "user", "content": "another newcomer"}])
    keys = ["a", "g0", "g1", "b", "g2", "g3", "c"]
    # a running episode feeds its last sampled token (never fed yet), the closing and the observation
    running = max(len(prompts[k]) - len(seen[i][0]) - len(seen[i][1].tokens) + 1 for i, k in enumerate("ab"))
    shapes = _record_forwards(engine)
    second = play(keys, list(range(10, 17)))
    assert shapes[0] == (2, len(opening)) and shapes[1] == (7, running), shapes[:2]
    assert len({tuple(o.tokens) for o in second[1:3] + second[4:6]}) > 1  # one prompt, four streams
    play(keys, list(range(20, 27)))
    for prompt, out in seen:
        torch.testing.assert_close(out.logprobs, full_logprobs(engine, prompt, out.tokens), atol=1e-4, rtol=0)


def test_a_newcomer_no_wider_than_the_running_feed_joins_its_forward(tiny_model, chat):
    """Prefilling apart costs a forward: a newcomer whose prompt is about as wide as what the
    running episodes feed (the text maze's openings and observations) is fed with them."""
    engine = perturbed_engine(tiny_model)
    params = SamplingParams(3, chat.stop_ids, temperature=1.0)
    a = chat.prompt_ids([{"role": "user", "content": "hi"}])
    out = engine.generate([a], params, sessions=["a"], seeds=[0])[0]
    a2 = a + out.tokens + chat.closing(out.tokens) + chat.observation_ids([{"role": "user", "content": "x" * 40}])
    b = chat.prompt_ids([{"role": "user", "content": "x" * 30}])
    shapes = _record_forwards(engine)
    second = engine.generate([a2, b], params, sessions=["a", "b"], seeds=[1, 2])
    assert shapes[0][0] == 2, shapes
    for prompt, o in [(a2, second[0]), (b, second[1])]:
        torch.testing.assert_close(o.logprobs, full_logprobs(engine, prompt, o.tokens), atol=1e-4, rtol=0)


def test_newcomers_share_a_prefill_only_when_their_pictures_match(tiny_vlm, vlm_chat):
    """Image episodes: five newcomers with the same text join a running one, four of them with
    the same picture: two prompts are prefilled, and each episode's log-probs, over two turns,
    equal a plain forward over its own pictures."""
    engine = TorchEngine(tiny_vlm, LoraSpec(rank=4), seed=3)
    params = SamplingParams(4, vlm_chat.stop_ids, temperature=1.0)
    pics = {"a": [_picture(0)]}
    prompts = {"a": vlm_chat.prompt_ids(_pictured("start", pics["a"][0]))}
    seen = []

    def play(keys, seeds):
        outs = engine.generate([prompts[k] for k in keys], params, sessions=keys, seeds=seeds,
                               images=[pics[k] for k in keys])
        for k, out in zip(keys, outs):
            seen.append((prompts[k], list(pics[k]), out))
            pics[k].append(_picture(100 + len(seen)))
            prompts[k] = prompts[k] + out.tokens + vlm_chat.closing(out.tokens) + vlm_chat.observation_ids(
                _pictured("moved", pics[k][-1]))

    play(["a"], [0])
    keys = ["g0", "a", "g1", "h", "g2", "g3"]
    for key in keys[:1] + keys[2:]:
        pics[key] = [_picture(2 if key == "h" else 1)]
        prompts[key] = vlm_chat.prompt_ids(_pictured("start, with the rules of the game " + "x" * 100, pics[key][0]))
    shapes = _record_forwards(engine)
    play(keys, [1, 2, 3, 4, 5, 6])
    assert shapes[0][0] == 2 and shapes[1][0] == 6 and shapes[1][1] < shapes[0][1], shapes[:2]
    play(keys, [7, 8, 9, 10, 11, 12])
    for prompt, images, out in seen:
        torch.testing.assert_close(out.logprobs, _full_vlm_logprobs(engine, prompt, images, out.tokens),
                                   atol=1e-4, rtol=0)


def test_the_engines_load_bf16_on_cuda_and_fp32_on_cpu_by_default(tiny_model):
    from actors.actor import ActorConfig
    from actors.engine import engine_dtype

    assert engine_dtype("auto", "cuda") == "bfloat16" and engine_dtype("auto", "cpu") == "float32"
    assert engine_dtype("float32", "cuda") == "float32"  # asked for: kept
    assert ActorConfig(gpus=1).engine_options()["dtype"] == "bfloat16"  # the torch engine on a GPU
    assert ActorConfig(device="cuda").engine_options()["dtype"] == "bfloat16"
    assert ActorConfig().engine_options()["dtype"] == "float32"
    assert ActorConfig(gpus=1, dtype="float32").engine_options()["dtype"] == "float32"
    engine = TorchEngine(tiny_model, LoraSpec(rank=4))  # "auto" on this CPU
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}


def test_top_k_and_top_p_truncate_and_renormalise():
    from actors.torch_engine import _truncate

    logp = torch.log(torch.tensor([[0.5, 0.2, 0.3, 0.0], [0.1, 0.6, 0.25, 0.05]]))
    k2 = _truncate(logp, 2, 1.0).exp()  # the two most probable of each row, renormalised
    torch.testing.assert_close(k2, torch.tensor([[0.625, 0.0, 0.375, 0.0], [0.0, 0.6 / 0.85, 0.25 / 0.85, 0.0]]))
    # top_p 0.6: row 0 keeps 0.5 (below 0.6) and 0.3 (the one that reaches it); row 1 keeps 0.6 alone
    p6 = _truncate(logp, 0, 0.6).exp()
    torch.testing.assert_close(p6, torch.tensor([[0.625, 0.0, 0.375, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    assert _truncate(logp, 0, 1.0) is logp and _truncate(logp, -1, 1.0) is logp
    for bad in ({"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(4, (), **bad)
