"""policy/attention.py: grouped-query attention on the CPU without repeated keys and values gives
transformers' "sdpa" numbers, forward and backward, with the masks the engine and learner pass."""

import pytest
import torch

from policy.attention import GQA_SDPA, use_gqa_sdpa
from policy.load import LoraSpec, load_model, with_lora


def _masked_batch(vocab: int):
    """Three rows: one whole, one right-padded, one with a hole in the middle (as the torch
    engine's cache has after a row fed fewer tokens than the others)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    mask[2, 5:9] = 0
    return ids, mask


def _pair(path: str):
    """The model at `path` twice, on transformers' "sdpa" and on GQA_SDPA, with the same LoRA adapter."""
    torch.manual_seed(0)
    stock = with_lora(load_model(path), LoraSpec())
    gqa = with_lora(load_model(path), LoraSpec())
    stock.get_base_model().set_attn_implementation("sdpa")
    for name, p in stock.named_parameters():  # B = 0 after init: give the adapter something to say
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    gqa.load_state_dict(stock.state_dict())
    return stock, gqa


def _count_grouped_kernels(monkeypatch) -> list:
    calls = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("which", ["tiny_model", "tiny_vlm"])
def test_loaded_models_attend_with_grouped_heads_and_give_sdpa_logits_and_gradients(which, request, monkeypatch):
    path = request.getfixturevalue(which)
    stock, gqa = _pair(path)
    base = gqa.get_base_model()
    assert base.config._attn_implementation == GQA_SDPA  # load_model switched it
    assert stock.get_base_model().config._attn_implementation == "sdpa"
    ids, mask = _masked_batch(100)
    out = {}
    for name, model in (("stock", stock), ("gqa", gqa)):
        calls = _count_grouped_kernels(monkeypatch)
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits.float() * mask[..., None]).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = (logits.detach(), grads, calls)
        monkeypatch.undo()
    (logits_a, grads_a, calls_a), (logits_b, grads_b, calls_b) = out["stock"], out["gqa"]
    assert not any(calls_a) and calls_b and all(calls_b)  # every decoder layer took the grouped kernel
    real = mask.bool()
    torch.testing.assert_close(logits_b[real], logits_a[real], rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and any("lora_B" in n for n in grads_a)
    for n in grads_a:
        torch.testing.assert_close(grads_b[n], grads_a[n], rtol=1e-4, atol=1e-6)


def test_qwen_vl_families_give_sdpa_logits(qwen_vl):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL (multimodal rotary positions) on GQA_SDPA: transformers' logits."""
    stock, gqa = _pair(qwen_vl)
    ids, mask = _masked_batch(100)
    with torch.no_grad():
        a = stock(input_ids=ids, attention_mask=mask).logits
        b = gqa(input_ids=ids, attention_mask=mask).logits
    assert gqa.get_base_model().config._attn_implementation == GQA_SDPA
    torch.testing.assert_close(b[mask.bool()], a[mask.bool()], rtol=1e-5, atol=1e-5)


def test_without_a_mask_or_on_another_attention_nothing_changes(tiny_model, monkeypatch):
    """No mask: transformers' own "sdpa" path (its causal kernel); an "eager" model stays eager."""
    model = load_model(tiny_model)
    calls = _count_grouped_kernels(monkeypatch)
    ids, _ = _masked_batch(100)
    with torch.no_grad():
        model(input_ids=ids[:1])
    assert calls  # the kernel ran, through transformers' path (its own choice of enable_gqa)
    monkeypatch.undo()
    eager = load_model(tiny_model)
    eager.set_attn_implementation("eager")
    use_gqa_sdpa(eager)
    assert eager.config._attn_implementation == "eager"


def test_the_torch_engine_samples_the_same_turns_on_either_attention(tiny_vlm, vlm_chat):
    """Two image episodes of unequal prompts for two turns (the engine's cache then has holes),
    seeded sampling: the same tokens and log-probs with transformers' "sdpa" as with GQA_SDPA."""
    from actors.engine import SamplingParams
    from actors.torch_engine import TorchEngine
    from tests.actors.test_engine import _picture, _pictured

    params = SamplingParams(5, vlm_chat.stop_ids, temperature=1.0)
    played = {}
    for name in ("stock", "gqa"):
        engine = TorchEngine(tiny_vlm, LoraSpec(rank=4), seed=3)
        if name == "stock":
            engine.model.get_base_model().set_attn_implementation("sdpa")
        assert engine.model.get_base_model().config._attn_implementation == ("sdpa" if name == "stock" else GQA_SDPA)
        pics = {"a": [_picture(0)], "b": [_picture(1)]}
        prompts = {"a": vlm_chat.prompt_ids(_pictured("start", pics["a"][0])),
                   "b": vlm_chat.prompt_ids(_pictured("a longer start, a longer start", pics["b"][0]))}
        outs = []
        for turn in range(2):
            done = engine.generate(list(prompts.values()), params, sessions=list(prompts), seeds=[turn, 10 + turn],
                                   images=list(pics.values()))
            outs += [(list(o.tokens), list(o.logprobs)) for o in done]
            for (key, prompt), out in zip(list(prompts.items()), done):
                pics[key].append(_picture(20 + turn))
                prompts[key] = prompt + out.tokens + vlm_chat.closing(out.tokens) + vlm_chat.observation_ids(
                    _pictured("moved", pics[key][-1]))
        played[name] = outs
        engine.close()
    for (tokens_a, logp_a), (tokens_b, logp_b) in zip(played["stock"], played["gqa"]):
        assert tokens_b == tokens_a and tokens_a
        torch.testing.assert_close(logp_b, logp_a, atol=1e-5, rtol=0)
