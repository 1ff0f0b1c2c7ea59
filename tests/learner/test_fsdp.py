"""A real 2-rank FSDP2 step over gloo, fed by a real replay service."""

import multiprocessing as mp
import socket

import numpy as np
import pytest

from replay.buffer import ReplayBuffer
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.server import ReplayServer
from tests.learner.ranks import as_rank
from tests.replay.helpers import make_group


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, model, endpoint, url, out):
    import torch

    from learner.config import LearnerConfig
    from learner.trainer import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    learner = Learner(LearnerConfig(lr=1e-2, groups_per_step=4), model, rank, 2, url, ZmqLearnerReplay(endpoint))
    try:
        learner.setup()
        before = {k: v.numpy().copy() for k, v in learner.adapter_tensors().items()}
        metrics = learner.step()
        after = {k: v.numpy() for k, v in learner.adapter_tensors().items()}
        out.put((rank, before, after, metrics))
    finally:
        learner.close()


def test_two_ranks_train_to_identical_changed_lora_weights(tiny_model):
    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=0, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqActorReplay(endpoint, actor="actor-0")
        for i in range(4):
            client.push(make_group(seed=i, rewards=[1.0, 0.0, 0.0, 1.0]))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        url = f"tcp://127.0.0.1:{_port()}"
        procs = [ctx.Process(target=as_rank, args=(_rank, r, tiny_model, endpoint, url, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = dict((r, (b, a, m)) for r, b, a, m in (out.get(timeout=240) for _ in procs))
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0], "a rank failed"
    finally:
        server.stop()
    (b0, a0, m0), (_, a1, m1) = results[0], results[1]
    assert m0["loss"] == m1["loss"]  # step metrics are reduced across ranks: both report the same
    assert a0.keys() == a1.keys() and any("lora_B" in k for k in a0)
    for k in a0:
        np.testing.assert_array_equal(a0[k], a1[k])  # every rank holds the same full adapter
    changed = [k for k in a0 if "lora_B" in k and not np.array_equal(a0[k], b0[k])]
    assert changed, "the optimizer step did not change the adapter"
    assert m0["version"] == 1 and m0["trajectories"] == 16  # 4 groups × 4, over both ranks
    assert server.buffer.stats.served_groups == 4


def _two_ranks(target, model, groups, *args) -> dict:
    """`groups` pushed to a real replay service (4 groups a step, η 1), then `target(rank, model,
    endpoint, url, *args, out)` on ranks 0 and 1; returns {rank: the rest of what it put}."""
    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=1, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqActorReplay(endpoint, actor="actor-0")
        for g in groups:
            client.push(g)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        url = f"tcp://127.0.0.1:{_port()}"
        procs = [ctx.Process(target=as_rank, args=(target, r, model, endpoint, url, *args, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = {r: rest for r, *rest in (out.get(timeout=300) for _ in procs)}
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0], "a rank failed"
    finally:
        server.stop()
    return results


def _ppo_rank(rank, model, endpoint, url, out):
    import torch

    from learner.config import LearnerConfig
    from learner.config import CRITIC
    from learner.trainer import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LearnerConfig(lr=1e-2, groups_per_step=4, mini_batches=2, kl_coef=0.1, entropy_coef=0.01, micro_batch=3,
                        behaviour_clip=2.0)
    learner = Learner(cfg, model, rank, 2, url, ZmqLearnerReplay(endpoint), algo="ppo", correction="decoupled")
    try:
        learner.setup()

        def critic():
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(learner.model, adapter_name=CRITIC)
            state["value_head"] = learner.value_head.proj.weight
            return {k: v.full_tensor().detach().numpy().copy() for k, v in state.items()}

        before, critic_before = learner.adapter_tensors(), critic()
        metrics = [learner.step(), learner.step()]
        # the reference is the base model itself: the adapter disabled, under fully_shard
        from learner.losses import token_logprobs
        from policy.load import load_model

        tokens = torch.tensor([make_group(seed=0).trajectories[0].tokens[:12].tolist()], dtype=torch.long)
        attention = torch.ones_like(tokens)
        ref = learner._ref_logprobs(tokens, attention, {})
        with torch.no_grad():
            base = token_logprobs(load_model(model)(input_ids=tokens, attention_mask=attention).logits, tokens)
            policy, _ = learner._policy_terms(tokens, attention, {})
        metrics.append({"ref_gap": float((ref - base).abs().max()), "policy_gap": float((policy - base).abs().max()),
                        "critic_trainable": all(p.requires_grad for p in learner.critic_params)})
        out.put((rank, {k: v.numpy() for k, v in before.items()},
                 {k: v.numpy() for k, v in learner.adapter_tensors().items()}, critic_before, critic(), metrics))
    finally:
        learner.close()


def test_ppo_trains_policy_and_critic_adapters_on_two_ranks(tiny_model):
    """PPO with the critic under fully_shard: two mini-batches a step (π_old from its own pass),
    decoupled correction, KL to the adapter-disabled reference, uneven micro-batches per rank."""
    groups = [make_group(seed=i, rewards=[1.0, 0.0, 0.0, 1.0] if i % 2 else [1.0, 1.0, 1.0, 1.0]) for i in range(8)]
    results = _two_ranks(_ppo_rank, tiny_model, groups)
    (b0, a0, cb0, ca0, m0), (_, a1, _, ca1, m1) = results[0], results[1]
    # only the policy adapter is gathered for the actors: no critic weights, no value head
    assert not any("critic" in k or "value" in k for k in a0) and any("lora_B" in k for k in a0)
    for k in a0:
        np.testing.assert_array_equal(a0[k], a1[k])
    for k in ca0:
        np.testing.assert_array_equal(ca0[k], ca1[k])  # the critic too is the same on both ranks
    assert any(not np.array_equal(a0[k], b0[k]) for k in a0 if "lora_B" in k), "policy adapter unchanged"
    assert any(not np.array_equal(ca0[k], cb0[k]) for k in ca0 if "lora_B" in k), "critic adapter unchanged"
    assert not np.array_equal(ca0["value_head"], cb0["value_head"]), "value head unchanged"
    checks = m0.pop()
    assert checks["ref_gap"] < 1e-5 and checks["policy_gap"] > 1e-3  # the policy has moved, the reference not
    assert checks["critic_trainable"]  # PEFT's disable_adapter() froze it; the learner restored it
    m1.pop()
    for m in m0:
        for key in ("value_loss", "explained_variance", "kl_ref", "entropy", "critic_grad_norm", "masked_fraction",
                    "clip_fraction", "behaviour_clip_fraction", "is_weight_mean", "mismatch_kl"):
            assert key in m and np.isfinite(m[key]), key
    assert m0[1]["version"] == 2 and m0[0]["trajectories"] == 16
    assert m0[0]["trained_fraction"] == 1.0  # the critic learns from uniform-reward groups too
    # the adapter starts as the identity (KL 0 on the first mini-batch) and has moved by the second
    assert 0 < m0[0]["kl_ref"] < 1 and m0[1]["kl_ref"] > 0


def _keep_rank(rank, model, endpoint, url, keep, algo, out):
    import torch
    from torch.distributed.tensor import DTensor

    from learner.config import LearnerConfig
    from learner.trainer import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LearnerConfig(lr=1e-2, groups_per_step=4, mini_batches=2, micro_batch=2, keep_gathered=keep)
    learner = Learner(cfg, model, rank, 2, url, ZmqLearnerReplay(endpoint), algo=algo)
    try:
        learner.setup()
        metrics = [learner.step(), learner.step()]
        modules = [m for m in (learner.model, learner.value_head) if m is not None]
        sharded = all(isinstance(p, DTensor) for m in modules for p in m.parameters())
        out.put((rank, {k: v.numpy() for k, v in learner.adapter_tensors().items()}, metrics, sharded,
                 learner.keep_gathered))
    finally:
        learner.close()


@pytest.mark.parametrize("algo", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_keeping_parameters_gathered_through_an_update_trains_the_same_adapter(tiny_model, algo):
    """--learner.keep-gathered (FSDP gathers once an update and reduces gradients once, after its
    last micro-batch) trains the adapter the default per-micro-batch collectives train: two steps of
    two mini-batches of several micro-batches each, with PPO's critic as its own FSDP root too; and
    every parameter is sharded again after a step."""
    adapters = {}
    for keep in ("off", "on"):
        groups = [make_group(seed=i, rewards=[1.0, 0.0, 0.0, 1.0] if i % 3 else [0.0, 1.0, 1.0, 1.0])
                  for i in range(8)]
        results = _two_ranks(_keep_rank, tiny_model, groups, keep, algo)
        (a0, m0, sharded0, kept0), (a1, _, sharded1, kept1) = results[0], results[1]
        assert kept0 == kept1 == (keep == "on")
        assert sharded0 and sharded1, "a parameter was left gathered after the step"
        for k in a0:
            np.testing.assert_array_equal(a0[k], a1[k])  # both ranks hold the same adapter
        assert m0[1]["version"] == 2
        adapters[keep] = a0, m0
    (off, m_off), (on, m_on) = adapters["off"], adapters["on"]
    for a, b in zip(m_off, m_on):  # gradients as large both ways (Adam alone would hide a scale)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
    assert off.keys() == on.keys() and any("lora_B" in k for k in on)
    assert any(np.abs(v).max() > 0 for k, v in on.items() if "lora_B" in k), "the steps did not train"
    # Equal up to summation order, which Adam's normalisation lifts on elements of near-zero
    # gradient: each B (zero at the start, so its value is its update) within 0.1% in norm.
    for k in (k for k in off if "lora_B" in k):
        assert np.linalg.norm(on[k] - off[k]) <= 1e-3 * np.linalg.norm(off[k]), k
    for k in off:
        np.testing.assert_allclose(on[k], off[k], atol=1e-4, err_msg=k)


def _one_rank(model, endpoint, url, out):
    import torch

    from learner.config import LearnerConfig
    from learner.trainer import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    learner = Learner(LearnerConfig(lr=1e-2, groups_per_step=2), model, 0, 1, url, ZmqLearnerReplay(endpoint))
    try:
        learner.setup()
        snapshot = learner.adapter_tensors()
        kept = {k: v.numpy().copy() for k, v in snapshot.items()}
        learner.step()
        moved = {k: v.numpy() for k, v in learner.adapter_tensors().items()}
        out.put((kept, {k: v.numpy() for k, v in snapshot.items()}, moved))
    finally:
        learner.close()


def test_adapter_snapshots_on_one_rank_do_not_follow_training(tiny_model):
    """With one rank `full_tensor()` is the parameter itself: a snapshot (what a stale actor
    generates with) must be a copy, not a view that the next step moves."""
    server = ReplayServer(ReplayBuffer(groups_per_step=2, max_staleness=0, num_shards=1), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqActorReplay(endpoint, actor="actor-0")
        for i in range(2):
            client.push(make_group(seed=i, rewards=[1.0, 0.0, 0.0, 1.0]))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=as_rank, args=(_one_rank, tiny_model, endpoint, f"tcp://127.0.0.1:{_port()}", out))
        p.start()
        kept, snapshot, moved = out.get(timeout=240)
        p.join(60)
        assert p.exitcode == 0
    finally:
        server.stop()
    assert any(not np.array_equal(moved[k], kept[k]) for k in kept if "lora_B" in k), "the step changed nothing"
    for k in kept:
        np.testing.assert_array_equal(snapshot[k], kept[k])


def _max_rank(rank, model, endpoint, url, out):
    import torch

    from learner.config import LearnerConfig
    from learner.trainer import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # tis without truncation (C = 1e6): each rank's largest π_old/μ is its own data's
    cfg = LearnerConfig(lr=1e-2, groups_per_step=4, is_cap=1e6)
    learner = Learner(cfg, model, rank, 2, url, ZmqLearnerReplay(endpoint), correction="tis")
    try:
        learner.setup()
        learner.version = 2  # as a learner resumed at version 2: rank 1's groups (version 0) are 2 stale
        local = []
        reduce = learner._reduce
        learner._reduce = lambda metrics: (local.append(dict(metrics)), reduce(metrics))[1]
        out.put((rank, local, learner.step()))
    finally:
        learner.close()


def test_maxima_are_reduced_over_ranks_with_max(tiny_model):
    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=2, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqActorReplay(endpoint, actor="actor-0")
        # first in, first served; rank 0's shard is the first two groups (version 2), rank 1's the next two
        for i, version in enumerate((2, 2, 0, 0)):
            client.push(make_group(seed=i, version=version, rewards=[1.0, 0.0, 0.0, 1.0]))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        url = f"tcp://127.0.0.1:{_port()}"
        procs = [ctx.Process(target=as_rank, args=(_max_rank, r, tiny_model, endpoint, url, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = {r: (local, m) for r, local, m in (out.get(timeout=240) for _ in procs)}
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0], "a rank failed"
    finally:
        server.stop()
    ([local0], m0), ([local1], m1) = results[0], results[1]
    assert (local0["staleness_max"], local1["staleness_max"]) == (0.0, 2.0)
    assert local0["is_weight_max"] != local1["is_weight_max"]
    for m in (m0, m1):  # both ranks report the maximum over ranks, not the mean
        assert m["staleness_max"] == 2.0 and m["staleness_mean"] == 1.0
        assert m["is_weight_max"] == max(local0["is_weight_max"], local1["is_weight_max"])
        assert m["tokens"] == local0["tokens"] + local1["tokens"]  # totals are sums
