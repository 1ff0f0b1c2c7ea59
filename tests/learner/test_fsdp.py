"""A real 2-rank FSDP2 step over gloo, fed by a real replay service."""

import multiprocessing as mp
import socket

import numpy as np

from replay.buffer import ReplayBuffer
from replay.client import ZmqReplayClient
from replay.server import ReplayServer
from tests.replay.helpers import make_group


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, model, endpoint, url, out):
    import torch

    from learner.trainer import Learner, LearnerConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    learner = Learner(LearnerConfig(lr=1e-2, groups_per_step=4), model, rank, 2, url, ZmqReplayClient(endpoint))
    try:
        learner.setup()
        before = {k: v.numpy().copy() for k, v in learner._adapter_tensors().items()}
        metrics = learner.step()
        after = {k: v.numpy() for k, v in learner._adapter_tensors().items()}
        out.put((rank, before, after, metrics))
    finally:
        learner.close()


def test_two_ranks_train_to_identical_changed_lora_weights(tiny_model):
    server = ReplayServer(ReplayBuffer(groups_per_step=4, max_staleness=0, num_shards=2), "tcp://127.0.0.1:*")
    endpoint = server.start()
    try:
        client = ZmqReplayClient(endpoint, actor="actor-0")
        for i in range(4):
            client.push(make_group(seed=i, rewards=[1.0, 0.0, 0.0, 1.0]))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        url = f"tcp://127.0.0.1:{_port()}"
        procs = [ctx.Process(target=_rank, args=(r, tiny_model, endpoint, url, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = dict((r, (b, a, m)) for r, b, a, m in (out.get(timeout=240) for _ in procs))
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0], "a rank aborted at exit"
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
