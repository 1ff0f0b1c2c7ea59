"""Checkpoints of a real 2-rank FSDP2 learner group over gloo (PPO: policy and critic adapters,
value head, AdamW state), saved, then loaded by a new group of processes as a resumed run would."""

import json
import multiprocessing as mp

import numpy as np
import pytest

from learner.checkpoint import CheckpointError, Checkpoints, resume_version
from replay.buffer import ReplayBuffer
from replay.zmq_client import ZmqActorReplay, ZmqLearnerReplay
from replay.server import ReplayServer
from tests.learner.ranks import as_rank
from tests.learner.test_fsdp import _port
from tests.replay.helpers import make_group

HORIZON = 6


def _learner(rank, model, endpoint, url, run_dir):
    import torch

    from learner.config import LearnerConfig
    from learner.trainer import Learner
    from weights.local import InProcessWeights

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LearnerConfig(lr=1e-2, groups_per_step=4, micro_batch=4)
    return Learner(cfg, model, rank, 2, url, ZmqLearnerReplay(endpoint), algo="ppo", horizon=HORIZON,
                   checkpoints=Checkpoints(run_dir, keep=2), publisher=InProcessWeights() if rank == 0 else None)


def _state(learner) -> dict:
    """What a checkpoint must bring back, as numpy: adapters (policy, critic), value head, AdamW
    moments and step counts, learning rates, versions, this rank's RNG."""
    import torch

    out = {f"adapter/{k}": v.numpy().copy() for k, v in learner.adapter_tensors().items()}
    for name, p in list(learner.model.named_parameters()) + [(f"head.{n}", p) for n, p in learner.value_head.named_parameters()]:
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[f"param/{name}"] = full.detach().cpu().numpy().copy()
            state = learner.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    t = state[key]
                    t = t.full_tensor() if hasattr(t, "full_tensor") else t
                    out[f"optim/{name}/{key}"] = t.detach().cpu().numpy().copy()
    out["lr"] = np.array([g["lr"] for g in learner.optimizer.param_groups])
    out["rng"] = torch.get_rng_state().numpy().copy()
    return out


def _first_run(rank, model, endpoint, url, run_dir, out):
    learner = _learner(rank, model, endpoint, url, run_dir)
    try:
        learner.setup()
        learner.step()
        learner.step()
        learner.checkpoints.save(learner)
        saved = _state(learner)
        learner.step()  # published as version 3, then the group "dies": version 3 is lost
        out.put((rank, saved, learner.version))
    finally:
        learner.close()


def _resumed_run(rank, model, endpoint, url, run_dir, out):
    learner = _learner(rank, model, endpoint, url, run_dir)
    try:
        learner.setup(resume=True)
        loaded = _state(learner)
        metrics = learner.step()
        out.put((rank, loaded, learner.steps_done, metrics))
    finally:
        learner.close()


def _run_ranks(target, model, endpoint, run_dir, out, ctx):
    url = f"tcp://127.0.0.1:{_port()}"
    procs = [ctx.Process(target=as_rank, args=(target, r, model, endpoint, url, str(run_dir), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        item = out.get(timeout=300)
        results[item[0]] = item[1:]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0], "a rank failed"
    return results


def test_a_resumed_group_has_the_saved_optimizer_state_learning_rate_and_weights(tiny_model, tmp_path):
    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=10, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    ctx = mp.get_context("spawn")
    try:
        client = ZmqActorReplay(endpoint, actor="actor-0")
        for i in range(16):
            client.push(make_group(seed=i, rewards=[1.0, 0.0, 0.5, 1.0]))
        first = _run_ranks(_first_run, tiny_model, endpoint, tmp_path, ctx.Queue(), ctx)
        resumed = _run_ranks(_resumed_run, tiny_model, endpoint, tmp_path, ctx.Queue(), ctx)
    finally:
        server.stop()

    ckpt = Checkpoints(tmp_path)
    assert [p.name for p in ckpt.all()] == ["step-000002"]
    meta = json.loads((ckpt.latest() / "meta.json").read_text())
    assert meta["step"] == 2 and meta["version"] == 2 and meta["horizon"] == HORIZON and meta["world"] == 2
    assert ckpt.published() == 5  # 3 by the first group; 4 (the checkpoint again) and 5 by the resumed one
    for rank in (0, 1):
        saved, _ = first[rank]
        loaded, steps_done, metrics = resumed[rank]
        assert set(loaded) == set(saved)
        assert any(k.startswith("optim/") and k.endswith("exp_avg") for k in saved), "no AdamW state was saved"
        assert any("critic" in k for k in saved) and any(k.startswith("param/head.") for k in saved)
        for k in saved:
            np.testing.assert_array_equal(loaded[k], saved[k], err_msg=k)
        # Versions go on above the highest published; the step count and the schedule from the checkpoint.
        assert steps_done == 3 and metrics["step"] == 3 and metrics["version"] == 5
        from learner.config import lr_factor

        assert metrics["lr"] == pytest.approx(1e-2 * lr_factor("cosine", 2, HORIZON, 0.1))
    lines = [json.loads(x) for x in (tmp_path / "trained" / "rank-0.jsonl").read_text().splitlines()]
    assert [(x["step"], x["version"]) for x in lines] == [(1, 1), (2, 2), (3, 3), (3, 5)]
    ids = [g for x in lines for g in x["groups"]]
    assert len(ids) == len(set(ids)) == 8  # 2 groups a step on each rank, never the same twice


def test_resume_versions_never_name_two_adapters():
    assert resume_version(saved=4, published=4) == 4  # nothing after the checkpoint: the same adapter
    assert resume_version(saved=4, published=7) == 8  # 5..7 were published and lost: a new number
    assert resume_version(saved=0, published=0) == 0


def test_a_version_recorded_as_trained_but_never_published_is_not_reused(tmp_path):
    """A run killed after a step was recorded as trained and before its adapter was published
    (`record_trained`, then `_publish`): the trained records name a version above the published
    one, and a resumed group goes on above both."""
    ckpt = Checkpoints(tmp_path)
    ckpt.record_published(3)
    for rank in (0, 1):
        for step in (1, 2, 3, 4):
            ckpt.record_trained(rank, step, step, [f"g{rank}{step}"])
    with open(tmp_path / "trained" / "rank-1.jsonl", "a") as f:
        f.write('{"version": 9, "st')  # a line torn by the kill
    assert ckpt.published() == 3 and ckpt.highest_version() == 4
    assert resume_version(saved=3, published=ckpt.highest_version()) == 5


def test_an_unreadable_checkpoint_is_refused_with_its_path(tmp_path):
    (tmp_path / "checkpoints" / "step-000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000004.tmp").mkdir()  # unfinished: never a checkpoint
    ckpt = Checkpoints(tmp_path)
    assert ckpt.latest().name == "step-000003"
    with pytest.raises(CheckpointError, match="step-000003 has no readable meta.json"):
        ckpt.meta(ckpt.latest())
    (tmp_path / "checkpoints" / "published").write_text("seven\n")
    with pytest.raises(CheckpointError, match="not a version number"):
        ckpt.published()
