"""A step's bookkeeping: micro-batch shares that sum to the full batch, metric reductions."""

import pytest
import torch

from learner.batch import Batch
from learner.losses import AGGREGATIONS, CORRECTIONS, correct, policy_loss
from learner.plan import StepSums, micro_batches, reduce_metrics, shares, token_micro_batches, trained_rows
from tests.learner.ranks import as_rank

close = torch.testing.assert_close


def test_a_dropped_token_weighs_the_same_in_a_micro_batch_as_in_the_batch():
    # Two trajectories of two action tokens, A = [2, 1], ratio 1 (π_θ = π_prox), decoupled with
    # π_prox/μ = [[1, 10], [1, 1]]: token (0, 1) is over the filter of 5 and dropped.
    prox = torch.zeros(2, 2)
    mu = torch.log(torch.tensor([[1.0, 0.1], [1.0, 1.0]]))
    mask = torch.ones(2, 2)
    adv = torch.tensor([2.0, 1.0])
    full, _ = policy_loss(prox, correct("decoupled", prox, mu, mask), adv, aggregation="token_mean")
    # the batch: -(2·1 + 0 + 1·1 + 1·1) / 4 action tokens = -1
    assert float(full) == pytest.approx(-1.0)
    chunks = micro_batches([0, 1], 1)
    weights = shares(chunks, mask, "token_mean")  # 2 of the 4 action tokens each: [0.5, 0.5]
    assert weights == [0.5, 0.5]
    parts = [float(policy_loss(prox[c], correct("decoupled", prox[c], mu[c], mask[c]), adv[c],
                               aggregation="token_mean")[0]) for c in chunks]
    # row 0 alone: -(2 + 0) / 2 = -1; row 1: -(1 + 1) / 2 = -1; 0.5·-1 + 0.5·-1 = -1, as the batch.
    # (Dividing by the tokens kept instead gave -2/1 for row 0, so -1.5, against -4/3 for the batch.)
    assert parts == pytest.approx([-1.0, -1.0])
    assert sum(w * p for w, p in zip(weights, parts)) == pytest.approx(float(full))


def _random_batch(seed: int):
    """12 trajectories, ragged action masks, two with zero advantage (skipped by the step), one
    without action tokens; π_old/μ spread so that decoupled's filter and geo-mask drop some."""
    g = torch.Generator().manual_seed(seed)
    b, t = 12, 10
    length = torch.randint(4, t + 1, (b,), generator=g)
    attention = (torch.arange(t)[None] < length[:, None]).long()
    mask = ((torch.rand(b, t, generator=g) < 0.7) & (attention > 0)).float()
    mask[:, 0] = 0  # the prompt
    mask[7] = 0     # a trajectory without action tokens
    mu = -3 * torch.rand(b, t, generator=g)
    old = mu + 0.3 * torch.randn(b, t, generator=g)
    old[:4] += 1.5  # π_old/μ around e^1.5 ≈ 4.5, often over 5: dropped by decoupled, off for geo-mask
    logp = old + 0.2 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    adv[[2, 9]] = 0.0
    batch = Batch(tokens=torch.zeros(b, t, dtype=torch.long), attention=attention, mask=mask, behaviour=mu,
                  advantages=adv, rewards=torch.zeros(b), staleness=torch.zeros(b))
    return batch, old, logp


@pytest.mark.parametrize("split", ["rows", "tokens"])
@pytest.mark.parametrize("mini_batches", [1, 2])
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_weighted_by_the_plan_sum_to_the_full_batch(aggregation, correction, mini_batches, split):
    for seed in range(3):
        batch, old, logp = _random_batch(seed)
        kwargs = {"aggregation": aggregation, "norm_length": 7, "clip_low": 0.2, "clip_high": 0.28}

        def loss(rows):
            theta = logp[rows].clone().requires_grad_(True)
            c = correct(correction, old[rows], batch.behaviour[rows], batch.mask[rows], cap=2.0, geo_bound=1.5)
            value, _ = policy_loss(theta, c, batch.advantages[rows], **kwargs)
            value.backward()
            return float(value.detach()), theta.grad, float(c.mask.sum())

        everything = list(range(12))
        full, full_grad, kept = loss(everything)
        if correction in ("decoupled", "geo-mask"):
            assert kept < float(batch.mask.sum()), "the inputs must make the correction drop tokens"
        live, minis = trained_rows(batch, critic=False, mini_batches=mini_batches)
        assert 2 not in live and 9 not in live  # zero advantage: no forward pass
        total, grad = 0.0, torch.zeros_like(logp)
        for mini in minis:
            if split == "rows":
                chunks = micro_batches(mini, 3)
            else:  # rows of 4 to 10 tokens within 16: micro-batches of one to four rows
                chunks = token_micro_batches(mini, batch.attention.sum(1).tolist(), 16)
                assert all(len(c) * int(batch.attention[c].sum(1).max()) <= 16 for c in chunks)
            for chunk, share in zip(chunks, shares(chunks, batch.mask, aggregation, mini_batches)):
                value, g, _ = loss(chunk)
                total += share * value
                grad[chunk] += share * g
        # every update is full scale: the k mini-batches together make k times the batch
        assert total == pytest.approx(mini_batches * full, rel=1e-5, abs=1e-6)
        close(grad, mini_batches * full_grad, rtol=1e-5, atol=1e-6)


def test_shares_count_the_whole_batch():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    chunks = micro_batches([0, 1, 2], 2)
    assert chunks == [[0, 1], [2]]
    # token_mean: 3 and 3 of the batch's 6 action tokens, times 2 mini-batches -> [1, 1]
    assert shares(chunks, mask, "token_mean", scale=2) == pytest.approx([1.0, 1.0])
    # per trajectory: 2 and 1 of the batch's 4 rows (row 3 is skipped, but counts) -> [0.5, 0.25]
    assert shares(chunks, mask, "seq_mean_token_mean") == pytest.approx([0.5, 0.25])


def test_token_budget_packs_sorted_rows_and_a_long_row_goes_alone():
    lengths = [3, 4, 4, 6, 13]
    # budget 12: [3, 4, 4] pads to 3 × 4 = 12; adding the 6 would make 4 × 6 = 24; 6 and 13
    # together 2 × 13 = 26; 13 alone is over the budget but goes anyway, alone
    chunks = token_micro_batches([0, 1, 2, 3, 4], lengths, 12)
    assert chunks == [[0, 1, 2], [3], [4]]
    assert token_micro_batches([4, 0], lengths, 12) == [[4], [0]]  # nothing joins a row over the budget
    assert token_micro_batches([0, 1, 2, 3, 4], lengths, 100) == [[0, 1, 2, 3, 4]]  # 5 × 13 = 65
    assert token_micro_batches([], lengths, 12) == []
    # shares: action tokens 1, 2, 2, 3, 5 (13 in all) -> token_mean [5/13, 3/13, 5/13];
    # per trajectory 3, 1 and 1 of 5 rows -> [0.6, 0.2, 0.2]
    mask = (torch.arange(13)[None] < torch.tensor([1, 2, 2, 3, 5])[:, None]).float()
    assert shares(chunks, mask, "token_mean") == pytest.approx([5 / 13, 3 / 13, 5 / 13])
    assert shares(chunks, mask, "seq_mean_token_mean") == pytest.approx([0.6, 0.2, 0.2])


def _one_step(model, configs, out):
    """One Learner.step of a world-1 learner for each config, from the same weights and batch."""
    import socket

    from learner.config import LearnerConfig
    from learner.trainer import Learner
    from replay.buffer import ReplayBuffer
    from replay.client import LocalReplay
    from tests.replay.helpers import make_group

    torch.set_num_threads(1)
    results = []
    for kwargs in configs:
        torch.manual_seed(0)
        replay = LocalReplay(ReplayBuffer(groups_per_step=2, max_staleness=0))
        for i, length in enumerate((20, 40)):
            replay.push(make_group(seed=i, length=length, rewards=[1.0, 0.0, 0.0, 1.0]))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        learner = Learner(LearnerConfig(lr=1e-2, groups_per_step=2, **kwargs), model, 0, 1, url, replay)
        passes, grads = [], []
        plan, clip = learner._plan, learner._clip

        def planned(batch, rows, shares=True):  # the micro-batches the trainer runs
            out = plan(batch, rows, shares)
            passes.extend(c for c, _ in out)
            return out

        def clipped(params):  # the accumulated gradient, before the optimizer step (AdamW's first is ≈ lr·sign(g))
            grads.extend(p.grad.full_tensor().numpy().copy() for p in params)
            return clip(params)

        learner._plan, learner._clip = planned, clipped
        try:
            learner.setup()
            metrics = learner.step()
            results.append((passes, metrics, grads))
        finally:
            learner.close()
    out.put(results)


def test_a_step_in_token_budget_micro_batches_equals_one_pass(tiny_model):
    import multiprocessing as mp

    import numpy as np

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=as_rank, args=(_one_step, tiny_model, [{"micro_batch": 16}, {"micro_batch_tokens": 100}], out))
    p.start()
    (whole, m_whole, g_whole), (budget, m_budget, g_budget) = out.get(timeout=240)
    p.join(60)
    assert p.exitcode == 0
    assert [len(c) for c in whole] == [8]
    # four rows of 20 tokens (80), then rows of 40 two at a time (3 × 40 = 120 is over 100)
    assert [len(c) for c in budget] == [4, 2, 2]
    assert m_budget["loss"] == pytest.approx(m_whole["loss"], rel=1e-5)
    assert m_budget["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-4)
    assert len(g_budget) == len(g_whole) and any(np.abs(g).max() > 0 for g in g_whole)
    for budget_grad, whole_grad in zip(g_budget, g_whole):  # float32 sums in another order
        np.testing.assert_allclose(budget_grad, whole_grad, rtol=1e-4, atol=1e-5 * np.abs(whole_grad).max())


def test_metrics_reduce_to_totals_maxima_minima_and_means():
    keys = ["is_weight_max", "loss", "staleness_max", "tokens", "trajectories", "x_min"]
    gathered = torch.tensor([[1.5, 0.25, 0.0, 100.0, 8.0, -1.0],
                             [3.0, 0.75, 2.0, 60.0, 8.0, -4.0]])  # rank 0, rank 1
    out = reduce_metrics(keys, gathered)
    # maxima: max(1.5, 3) = 3 and max(0, 2) = 2 (the mean, 2.25 and 1, hid the outliers); minimum -4
    assert out["is_weight_max"] == 3.0 and out["staleness_max"] == 2.0 and out["x_min"] == -4.0
    # totals: 100 + 60 = 160 tokens, 16 trajectories; mean loss (0.25 + 0.75) / 2 = 0.5
    assert out["tokens"] == 160.0 and out["trajectories"] == 16.0 and out["loss"] == 0.5


def test_step_sums_weigh_micro_batches_by_their_share():
    sums = StepSums()
    sums.add(2.0, {"policy_loss": 2.0, "is_weight_max": 1.5}, 0.75)
    sums.add(-1.0, {"policy_loss": -1.0, "is_weight_max": 4.0}, 0.25)
    sums.add(9.0, {"policy_loss": 9.0, "is_weight_max": 0.0}, 0.0)  # a padding micro-batch
    # loss 0.75·2 + 0.25·-1 = 1.25; mean policy_loss 1.25 / (0.75 + 0.25) = 1.25; max weight 4
    assert sums.loss == pytest.approx(1.25) and sums.means() == {"policy_loss": pytest.approx(1.25)}
    assert sums.is_weight_max == 4.0
