"""learner/model.py on a real 2-rank FSDP2 group over gloo: meta-device loading from rank 0,
bf16 mixed precision with fp32 LoRA and AdamW state, activation checkpointing, fused LoRA layers."""

import multiprocessing as mp
import queue
import time

import numpy as np
import pytest

from replay.buffer import ReplayBuffer
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.server import ReplayServer
from tests.learner.ranks import as_rank
from tests.learner.test_fsdp import _port
from tests.replay.helpers import make_group


def _spawn(target, *args, timeout=300) -> dict:
    """Run `target(rank, url, *args, out)` on ranks 0 and 1; returns {rank: what it put in out}."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    url = f"tcp://127.0.0.1:{_port()}"
    procs = [ctx.Process(target=as_rank, args=(target, r, url, *args, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            rank, value = out.get(timeout=1)
            results[rank] = value
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank died: fail now, not at the timeout
    for p in procs:
        p.join(60 if len(results) == len(procs) else 1)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a rank failed"
    return results


def _group(rank, url):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
    return init_device_mesh("cpu", (2,))


def _tokens():
    import torch

    tokens = torch.tensor([make_group(seed=s).trajectories[0].tokens[:24].tolist() for s in (0, 1)], dtype=torch.long)
    attention = torch.ones_like(tokens)
    attention[1, 20:] = 0  # right padding, as the learner's batches have
    return tokens, attention


def _loaded_rank(rank, url, model_path, out):
    import torch
    import torch.distributed as dist

    from learner.losses import token_logprobs
    from learner.model import build_policy
    from policy.load import LoraSpec, load_model, with_lora

    mesh = _group(rank, url)
    try:
        torch.manual_seed(3)
        model, _ = build_policy(model_path, LoraSpec(), mesh, torch.device("cpu"), torch.float32, critic=True)
        local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if not p.requires_grad}
        full = {n: tuple(p.shape) for n, p in model.named_parameters() if not p.requires_grad}
        lora = {n: p.full_tensor().detach().numpy().copy() for n, p in model.named_parameters() if "lora_" in n}
        tokens, attention = _tokens()
        with torch.no_grad():
            logp = token_logprobs(model(input_ids=tokens, attention_mask=attention).logits, tokens)
        inner = model.base_model.model
        tied = inner.lm_head.weight is inner.model.embed_tokens.weight
        torch.manual_seed(3)  # the plain way: the whole model on this rank, PEFT's adapters from the same seed
        plain = with_lora(load_model(model_path), LoraSpec())
        with torch.no_grad():
            plain_logp = token_logprobs(plain(input_ids=tokens, attention_mask=attention).logits, tokens)
        plain_lora = {n: p.detach().numpy().copy() for n, p in plain.named_parameters() if "lora_" in n}
        out.put((rank, dict(logp=logp.numpy(), plain_logp=plain_logp.numpy(), local=local, full=full, lora=lora,
                            plain_lora=plain_lora, tied=tied)))
    finally:
        dist.destroy_process_group()


def test_meta_loading_shards_the_base_and_equals_a_plain_load(tiny_model):
    results = _spawn(_loaded_rank, tiny_model)
    r0, r1 = results[0], results[1]
    for r in (r0, r1):
        # the same log-probs as the whole model loaded plainly: weights and the rotary buffers
        # (recomputed, not left as to_empty's garbage) are right on every rank
        np.testing.assert_allclose(r["logp"], r["plain_logp"], atol=1e-6, rtol=0)
        assert np.abs(r["plain_logp"]).max() > 1.0  # a real comparison, not of zeros
        assert r["tied"]  # the tied output head is still the embedding, not a second copy
        # the policy adapter is PEFT's own from the caller's seed: A as PEFT draws it, B zero
        for name, value in r["plain_lora"].items():
            np.testing.assert_array_equal(r["lora"][name], value)
        assert all(not v.any() for n, v in r["lora"].items() if "lora_B" in n)
        assert any(v.any() for n, v in r["lora"].items() if "lora_A" in n)
    assert any(".critic." in n for n in r0["lora"])
    for name, shape in r0["full"].items():
        # each rank holds only its dim-0 chunk of every frozen base weight
        rows = shape[0]
        assert r0["local"][name][0] + r1["local"][name][0] == rows, name
        assert r0["local"][name][0] == -(-rows // 2) and r0["local"][name][1:] == shape[1:], name
    local_numel = sum(np.prod(s) for s in r1["local"].values())
    assert local_numel < 0.55 * sum(np.prod(s) for s in r1["full"].values())


def _bf16_rank(rank, url, model_path, endpoint, algo, out):
    import torch

    from learner.config import LearnerConfig
    from learner.losses import token_logprobs
    from learner.trainer import Learner
    from policy.load import load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LearnerConfig(lr=1e-2, groups_per_step=4, dtype="bfloat16")
    from weights.publisher import WeightPublisher

    key = b"run key"
    publisher = WeightPublisher(key=key) if rank == 0 else None
    learner = Learner(cfg, model_path, rank, 2, url, ZmqLearnerReplay(endpoint), algo=algo, publisher=publisher)
    try:
        learner.setup()
        model = learner.model
        dtypes = {n: (p.dtype, p.requires_grad) for n, p in model.named_parameters()}
        if learner.value_head is not None:
            dtypes.update({f"value_head.{n}": (p.dtype, True) for n, p in learner.value_head.named_parameters()})
        tokens, attention = _tokens()
        with torch.no_grad():
            logits = model(input_ids=tokens, attention_mask=attention).logits
            fp32 = load_model(model_path)(input_ids=tokens, attention_mask=attention).logits
        gap = (token_logprobs(logits, tokens) - token_logprobs(fp32, tokens))[attention.bool()].abs()
        before = learner.adapter_tensors()
        metrics = learner.step()
        after = learner.adapter_tensors()
        state = [s for p in learner.policy_params + learner.critic_params for s in learner.optimizer.state[p].values()
                 if s.ndim > 0]
        wire = None
        if rank == 0:  # what the actors get: the new version, as a subscriber asks for it
            from weights.subscriber import WeightSubscriber

            sub = WeightSubscriber(publisher.endpoints, key=key)
            got = sub.latest(timeout=20)
            sub.close()
            wire = dict(version=got.version, dtypes={v.dtype for v in got.tensors.values()},
                        equal=all(torch.equal(got.tensors[k], after[k].bfloat16()) for k in after))
        out.put((rank, dict(wire=wire, dtypes=dtypes, logits_dtype=logits.dtype, gap_max=float(gap.max()),
                            gap_mean=float(gap.mean()), loss=metrics["loss"],
                            adapter_dtypes={v.dtype for v in after.values()},
                            changed=[k for k in after if not torch.equal(after[k], before[k])],
                            state_dtypes={s.dtype for s in state}, states=len(state))))
    finally:
        learner.close()
        if publisher is not None:
            publisher.close()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_bf16_mixed_precision_keeps_lora_and_adamw_in_fp32(tiny_model, algo):
    import torch

    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=0, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqActorReplay(endpoint, actor="actor-0")
        for i in range(4):
            client.push(make_group(seed=i, rewards=[1.0, 0.0, 0.0, 1.0]))
        results = _spawn(_bf16_rank, tiny_model, endpoint, algo)
    finally:
        server.stop()
    for r in results.values():
        lora = {n: d for n, (d, trained) in r["dtypes"].items() if trained}
        base = {n: d for n, (d, trained) in r["dtypes"].items() if not trained}
        assert lora and all("lora_" in n or "value_head" in n for n in lora) and set(lora.values()) == {torch.float32}
        assert any("value_head" in n for n in lora) == (algo == "ppo")  # PPO's critic: fp32 adapter and head
        assert base and set(base.values()) == {torch.bfloat16}
        assert r["logits_dtype"] == torch.bfloat16  # computed in bf16, not in the fp32 of the LoRA weights
        # log-probs within bf16's rounding of the fp32 model's, and not equal to them
        assert 0 < r["gap_mean"] < 0.01 and r["gap_max"] < 0.05, (r["gap_mean"], r["gap_max"])
        assert np.isfinite(r["loss"])
        assert r["changed"] and all("lora_B" in k or "lora_A" in k for k in r["changed"])
        assert r["adapter_dtypes"] == {torch.float32}  # the learner's snapshot
        assert r["states"] > 0 and r["state_dtypes"] == {torch.float32}  # AdamW's moments
    assert results[0]["changed"] == results[1]["changed"] and results[0]["loss"] == results[1]["loss"]
    # on the wire, bf16: half the bytes, the snapshot rounded once
    assert results[0]["wire"] == dict(version=1, dtypes={torch.bfloat16}, equal=True)


def _random_b(model, mesh) -> None:
    """Every LoRA B of a sharded model set to the same random values each call (B = 0 would leave
    A without gradient and the adapter the identity)."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            full = torch.randn(p.shape, generator=gen) * 0.1
            p.to_local().detach().copy_(distribute_tensor(full, mesh, [Shard(0)]).to_local())


def _checkpointing_rank(rank, url, model_path, out):
    import torch
    import torch.distributed as dist

    from learner.losses import token_logprobs
    from learner.model import build_policy, decoder_layers
    from policy.load import LoraSpec

    mesh = _group(rank, url)
    try:
        tokens, attention = _tokens()
        grads, calls = {}, {}
        for checkpointing in (False, True):
            torch.manual_seed(0)
            model, _ = build_policy(model_path, LoraSpec(), mesh, torch.device("cpu"), torch.float32,
                                    checkpointing=checkpointing)
            _random_b(model, mesh)
            count = [0]
            # a pre-hook: the replay stops early once it has what the backward needs, before the mlp returns
            decoder_layers(model)[1].mlp.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
            model.train()
            logp = token_logprobs(model(input_ids=tokens, attention_mask=attention).logits, tokens)
            (logp * attention).sum().backward()
            grads[checkpointing] = {n: p.grad.full_tensor().numpy().copy() for n, p in model.named_parameters()
                                    if p.grad is not None}
            calls[checkpointing] = count[0]
        out.put((rank, dict(grads=grads, calls=calls)))
    finally:
        dist.destroy_process_group()


def test_activation_checkpointing_recomputes_layers_and_keeps_the_gradients(tiny_model):
    results = _spawn(_checkpointing_rank, tiny_model)
    for r in results.values():
        assert r["calls"] == {False: 1, True: 2}  # the layer's forward replayed in the backward
        plain, checkpointed = r["grads"][False], r["grads"][True]
        assert plain.keys() == checkpointed.keys()
        assert any("lora_A" in n for n in plain) and all("lora_" in n for n in plain)
        assert all(np.abs(g).max() > 0 for g in plain.values())  # every adapter weight gets a gradient
        for name in plain:
            np.testing.assert_allclose(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, err_msg=name)


def _fused_rank(rank, url, model_path, out):
    import torch
    import torch.distributed as dist
    from peft.tuners.lora import Linear

    from learner.config import CRITIC
    from learner.critic import route
    from learner.losses import token_logprobs
    from learner.model import build_policy
    from policy.load import LoraSpec

    def fused(model) -> tuple[int, int]:
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        return sum("forward" in vars(m) for m in layers), len(layers)

    mesh = _group(rank, url)
    cpu = torch.device("cpu")
    try:
        tokens, attention = _tokens()
        results = {}
        for fuse in (False, True):
            torch.manual_seed(0)
            model, _ = build_policy(model_path, LoraSpec(), mesh, cpu, torch.float32, critic=True, fused=fuse)
            _random_b(model, mesh)  # both adapters away from the identity
            layers = [m for m in model.modules() if isinstance(m, Linear)]
            model.train()
            logp = token_logprobs(model(input_ids=tokens, attention_mask=attention).logits, tokens)
            with route(layers, CRITIC):  # PPO's critic: the same layers through its adapter
                critic = token_logprobs(model(input_ids=tokens, attention_mask=attention).logits, tokens)
            ((logp + 0.5 * critic) * attention).sum().backward()
            with torch.no_grad(), model.disable_adapter():
                base = token_logprobs(model(input_ids=tokens, attention_mask=attention).logits, tokens)
            grads = {n: p.grad.full_tensor().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
            results[fuse] = dict(logp=logp.detach().numpy(), critic=critic.detach().numpy(), base=base.numpy(),
                                 grads=grads, fused=fused(model))
        thin, _ = build_policy(model_path, LoraSpec(rank=2), mesh, cpu, torch.float32, fused=True)
        half, _ = build_policy(model_path, LoraSpec(), mesh, cpu, torch.bfloat16, fused=True)
        results["thin"], results["bf16"] = fused(thin), fused(half)
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


def test_fused_lora_layers_give_peft_values_and_gradients_for_both_adapters(tiny_model):
    """Every LoRA layer of the built-in model at rank 32 is computed as one linear map (W + s·B·A)
    and gives PEFT's log-probs, its critic's, the base's with adapters disabled, and the gradients of
    both adapters, on two FSDP ranks; thin adapters (rank 2) and bfloat16 compute keep PEFT's path."""
    results = _spawn(_fused_rank, tiny_model)
    for r in results.values():
        peft, fused = r[False], r[True]
        assert peft["fused"][0] == 0 and fused["fused"][0] == fused["fused"][1] > 0
        assert r["thin"][0] == 0 < r["thin"][1] and r["bf16"][0] == 0 < r["bf16"][1]
        for key in ("logp", "critic", "base"):
            np.testing.assert_allclose(fused[key], peft[key], rtol=1e-5, atol=1e-5, err_msg=key)
        assert np.abs(peft["logp"] - peft["base"]).max() > 1e-3  # the adapter changes what is compared
        assert peft["grads"].keys() == fused["grads"].keys()
        assert any(".critic." in n for n in peft["grads"]) and any(".default." in n for n in peft["grads"])
        for name, g in peft["grads"].items():
            assert np.abs(g).max() > 0, name
            # summation order differs: each entry within 1e-5 of the tensor's largest
            np.testing.assert_allclose(fused["grads"][name], g, rtol=1e-4, atol=1e-5 * np.abs(g).max(), err_msg=name)


@pytest.mark.parametrize("name", ["float16", "bf16"])
def test_an_unknown_dtype_is_refused_with_the_choices(name):
    from learner.config import LearnerConfig

    with pytest.raises(ValueError, match=f"unknown --learner.dtype '{name}'; choose one of auto, float32, bfloat16"):
        LearnerConfig(dtype=name)


def test_auto_dtype_is_bf16_on_cuda_and_fp32_on_cpu():
    import torch

    from learner.model import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda", 0)) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
