"""A vision-language learner: two FSDP ranks over gloo train on image-maze episodes that the
torch engine played, scoring exactly the tokens and pictures the engine saw."""


import numpy as np
import pytest

from replay.buffer import ReplayBuffer
from replay.server import ReplayServer
from replay.wire import Group
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from tests.learner.test_model import _spawn

TEMPERATURE = 0.7


def _image_groups(model: str, n: int) -> list[Group]:
    """`n` GRPO groups of 4 image-maze episodes played by the torch engine at the training
    temperature (a fresh adapter: the base model, as a learner at version 0 holds it)."""
    import torch

    from actors.engine import SamplingParams
    from actors.envrunner import EnvRunner
    from actors.torch_engine import TorchEngine
    from bench.gpu_check import image_maze_groups
    from policy.load import LoraSpec, load_chat

    torch.set_num_threads(1)
    engine, chat, runner = TorchEngine(model, LoraSpec(rank=4), seed=1), load_chat(model), EnvRunner(threads=2)
    try:
        return image_maze_groups(engine, chat, runner, n, SamplingParams(4, chat.stop_ids, temperature=TEMPERATURE))
    finally:
        runner.close()
        engine.close()


def _rank(rank, url, model, endpoint, groups, algo, out):
    import torch

    from learner.batch import collate
    from learner.config import LearnerConfig
    from learner.trainer import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    learner = Learner(LearnerConfig(lr=1e-2, groups_per_step=2), model, rank, 2, url, ZmqLearnerReplay(endpoint),
                      temperature=TEMPERATURE, algo=algo)
    try:
        learner.setup()
        batch = collate(groups, 0, learner.pad_id, algo=algo)
        rows = list(range(len(batch.tokens)))
        tokens, attention, pixels, width = learner._inputs(batch, rows)
        mask = batch.mask[:, :width].bool()
        with torch.no_grad():
            logp = learner._policy_terms(tokens, attention, pixels)[0]
            grey = learner.scheme.pixels([[np.full_like(img, 128) for img in row] for row in batch.images])
            other = {**pixels, **grey}  # the same tokens and positions, other pictures
            blind = learner._policy_terms(tokens, attention, other)[0]
        behaviour = batch.behaviour[:, :width]
        gap = float((logp - behaviour)[mask].abs().max())
        blind_gap = float((blind - behaviour)[mask].abs().max())
        metrics = learner.step()
        from torch.distributed.tensor import DTensor

        # the frozen vision layers, which no gradient reaches, sharded again too after the step
        metrics["all_sharded"] = all(isinstance(p, DTensor) for p in learner.model.parameters())
        out.put((rank, (gap, blind_gap, metrics, sorted(learner.adapter_tensors()))))
    finally:
        learner.close()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_two_ranks_score_image_episodes_as_the_engine_sampled_them_and_train(tiny_vlm, algo):
    """The learner's log-probs of the engine's tokens, with the episodes' pictures, equal the
    behaviour log-probs (the text path's tolerance); with other pictures they do not, so the
    pictures reach the learner. A step then trains the language model's adapter only."""
    _score_and_train(tiny_vlm, algo, ".text_model.")


@pytest.mark.slow  # ~25 s a family: two ranks, and the engine's episodes first
def test_two_ranks_score_qwen_image_episodes_as_the_engine_sampled_them_and_train(qwen_vl):
    """The same for the Qwen-VL families: the learner passes the rows' M-RoPE positions, its
    FSDP units include the vision tower's blocks, and the engine's multi-turn image episodes
    (its cache kept across turns) score as they were sampled."""
    _score_and_train(qwen_vl, "grpo", ".language_model.")


def test_qwen_image_episodes_score_as_the_engine_sampled_them(qwen_vl):
    """One process, the learner's scoring (learner/logprobs.py) on padded rows with the rows'
    M-RoPE positions (policy/vision.py `batch_positions`, as `Learner._inputs` builds them):
    Qwen-VL image-maze episodes that the torch engine played turn by turn in its kept cache
    score as they were sampled (the text path's tolerance)."""
    import torch

    from learner.batch import collate
    from learner.logprobs import model_terms
    from policy.load import LoraSpec, load_model, with_lora
    from policy.vision import batch_positions, scheme_for

    groups = _image_groups(qwen_vl, 2)
    batch = collate(groups, 0, 0)
    assert batch.images is not None and max(len(i) for i in batch.images) >= 2
    lengths = batch.attention.sum(1).tolist()
    assert len(set(lengths)) > 1, "the rows should differ in length (padding)"
    scheme = scheme_for(qwen_vl)
    inputs = dict(scheme.pixels(batch.images), position_ids=batch_positions(scheme, batch.tokens, lengths,
                                                                          batch.images))
    model = with_lora(load_model(qwen_vl), LoraSpec(rank=4)).eval()
    with torch.no_grad():
        logp, _ = model_terms(model, batch.tokens, batch.attention, TEMPERATURE, chunk=64, pixels=inputs,
                              banned=scheme.special_ids)
    mask = batch.mask.bool()
    assert float((logp - batch.behaviour)[mask].abs().max()) < 1e-4


def test_the_qwen_vision_blocks_are_fsdp_units(qwen_vl):
    """Each of Qwen-VL's vision blocks (`model.visual.blocks`) is an FSDP unit, as its decoder
    layers are, so no rank gathers the whole vision tower at once."""
    from learner.model import decoder_layers
    from policy.load import LoraSpec, load_model, with_lora

    model = with_lora(load_model(qwen_vl), LoraSpec(rank=2))
    units = decoder_layers(model)
    inner = model.base_model.model.model
    assert len(units) == 4 and set(map(id, units)) == set(map(id, [*inner.visual.blocks, *inner.language_model.layers]))


def _score_and_train(model: str, algo: str, text_part: str) -> None:
    tiny_vlm = model
    groups = _image_groups(tiny_vlm, 4)
    assert all(len(t.images) >= 2 for g in groups for t in g.trajectories)
    server = ReplayServer(ReplayBuffer(groups_per_step=2, max_staleness=0, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqActorReplay(endpoint, actor="actor-0")
        for g in groups[2:]:
            client.push(g)
        results = _spawn(_rank, tiny_vlm, endpoint, groups[:2], algo)
    finally:
        server.stop()
    for gap, blind_gap, metrics, names in results.values():
        assert gap < 1e-4, f"learner and engine disagree on image episodes by {gap}"
        assert blind_gap > 1e-3, "other pictures left the learner's log-probs unchanged"
        assert metrics["mismatch_kl"] < 1e-6 and np.isfinite(metrics["loss"])
        assert metrics["all_sharded"], "a parameter was left gathered after the step"
        assert names and all(text_part in n for n in names), "the adapter reached the vision tower"
        if algo == "ppo":
            assert np.isfinite(metrics["value_loss"])
    assert server.buffer.stats.served_groups == 2
