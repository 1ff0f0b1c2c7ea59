"""Chunked log-probs and entropy from the last hidden state equal the whole-logits ones: values,
entropy and gradients, by hand, on a real PEFT model with tied embeddings, and under a real
2-rank gloo FSDP2 learner."""

import math
import multiprocessing as mp

import pytest
import torch

from learner.logprobs import chunked_terms, model_terms, target_logprobs
from learner.losses import token_entropy, token_logprobs
from tests.learner.ranks import as_rank
from tests.learner.test_fsdp import _port

close = torch.testing.assert_close


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_hand_worked_log_probs_and_entropy(chunk):
    # The head is the identity (H = V = 2), so the hidden states are the logits:
    # position 0: [0, ln 3] -> p = [1/4, 3/4]; position 1: [0, 0] -> p = [1/2, 1/2]; position 2 predicts nothing.
    hidden = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [5.0, 5.0]]])
    tokens = torch.tensor([[0, 1, 0]])
    logp, entropy = chunked_terms(hidden, lambda h: h, tokens, chunk=chunk, entropy=True)
    # entry 0: no prediction; entry 1 = log p(1) = ln 0.75; entry 2 = log p(0) = ln 0.5
    close(logp, torch.tensor([[0.0, math.log(0.75), math.log(0.5)]]))
    # −(¼ ln ¼ + ¾ ln ¾) = 0.5623351 and ln 2 = 0.6931472
    close(entropy, torch.tensor([[0.0, 0.5623351, 0.6931472]]))
    # at temperature 2 position 0's logits are [0, ln 3 / 2]: p(1) = √3 / (1 + √3) = 0.6339746
    logp, _ = chunked_terms(hidden, lambda h: h, tokens, temperature=2.0, chunk=chunk)
    close(logp[0, 1], torch.tensor(math.log(0.6339746)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_hidden_state_gradients_equal_the_whole_logits(temperature):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    with torch.no_grad():  # drawn from the test's own generator, not from whatever ran before it
        head.weight.copy_(torch.randn(300, 16, generator=g) / 4)
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    tokens = torch.randint(0, 300, (3, 11), generator=g)
    w, u = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)

    def grads(terms):
        hidden.grad, head.weight.grad = None, None
        logp, entropy = terms()
        ((logp * w).sum() + (entropy * u).sum()).backward()
        return logp.detach(), entropy.detach(), hidden.grad.clone(), head.weight.grad.clone()

    whole = grads(lambda: (token_logprobs(head(hidden), tokens, temperature),
                           token_entropy(head(hidden), temperature)))
    for chunk in (1, 4, 7, 30, 1000):  # 30 positions in all: chunks of one, uneven ones, one chunk
        chunked = grads(lambda: chunked_terms(hidden, head, tokens, temperature, chunk, entropy=True,
                                              entropy_grad=True))
        for a, b in zip(whole, chunked):  # sums over other chunkings: float32's rounding apart
            close(b, a, rtol=1e-5, atol=1e-5)


def test_the_entropy_is_a_metric_without_its_coefficient_and_no_grad_builds_no_graph():
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    tokens = torch.randint(0, 50, (2, 6))
    logp, entropy = chunked_terms(hidden, head, tokens, chunk=4, entropy=True)
    assert logp.requires_grad and not entropy.requires_grad
    close(entropy, token_entropy(head(hidden), 1.0).detach(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # π_old and the reference: no checkpointing, no graph
        logp, none = chunked_terms(hidden, head, tokens, chunk=4)
    assert none is None and not logp.requires_grad
    close(logp, token_logprobs(head(hidden), tokens).detach(), rtol=1e-6, atol=1e-6)


def _lora_model():
    """The built-in tiny decoder (tied embeddings) with a LoRA adapter that is not the identity."""
    from policy.load import LoraSpec, with_lora
    from policy.tiny import build_model, build_tokenizer

    torch.manual_seed(0)
    model = with_lora(build_model(build_tokenizer()), LoraSpec(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)  # zero B leaves A without gradient
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_peft_model_gives_the_same_values_and_lora_gradients_chunked(temperature):
    model = _lora_model()
    head = model.get_output_embeddings()
    assert head.weight is model.get_input_embeddings().weight  # tied, and it stays so: the head is called, not copied
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 100, (3, 19), generator=g)
    attention = torch.ones_like(tokens)
    tokens[1, 13:], attention[1, 13:] = 0, 0  # a padded row
    w, u = torch.randn(3, 19, generator=g), torch.randn(3, 19, generator=g)

    def run(chunk):
        model.zero_grad(set_to_none=True)
        logp, entropy = model_terms(model, tokens, attention, temperature, chunk, entropy=True, entropy_grad=True)
        ((logp * w).sum() + (entropy * u).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logp.detach(), entropy.detach(), grads

    logp, entropy, grads = run(0)
    assert len(grads) == sum("lora_" in n for n, _ in model.named_parameters()) and all("lora_" in n for n in grads)
    assert all(float(g.abs().max()) > 0 for g in grads.values())
    for chunk in (5, 1024):
        c_logp, c_entropy, c_grads = run(chunk)
        close(c_logp, logp, rtol=1e-6, atol=1e-6)
        close(c_entropy, entropy, rtol=1e-6, atol=1e-6)
        assert c_grads.keys() == grads.keys()
        for n in grads:  # float32 sums in another order: equal to a few ulps of the largest entry
            close(c_grads[n], grads[n], rtol=1e-5, atol=1e-5 * float(grads[n].abs().max()))


def _fsdp_rank(rank, model, dtype, url, out):
    from learner.config import LearnerConfig
    from learner.trainer import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    learner = Learner(LearnerConfig(entropy_coef=0.01, dtype=dtype), model, rank, 2, url, replay=None,
                      temperature=0.7)
    try:
        learner.setup()
        with torch.no_grad():  # the same B on both ranks (seeded), each rank's shard of it
            for name, p in learner.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.distributed.tensor.distribute_tensor(
                        0.05 * torch.randn(p.shape), p.device_mesh, p.placements))
        g = torch.Generator().manual_seed(rank)
        length = 23 + 9 * rank  # the ranks run different numbers of chunks
        tokens = torch.randint(4, 100, (3, length), generator=g)
        attention = torch.ones_like(tokens)
        tokens[1, length - 6:], attention[1, length - 6:] = 0, 0
        w = torch.randn(3, length, generator=g)
        results = {}
        for reshard in (False, True):  # the root unit kept unsharded after forward (FSDP's default), or not
            learner.model.set_reshard_after_forward(reshard, recurse=False)
            for chunk in (0, 5):
                learner.cfg.logit_chunk = chunk
                learner.optimizer.zero_grad(set_to_none=True)
                logp, entropy = learner._policy_terms(tokens, attention, {}, entropy=True)
                ref = learner._ref_logprobs(tokens, attention, {})  # another root forward before the backward
                ((logp * w).sum() + (entropy * w.flip(1)).sum() + ((logp - ref) ** 2).sum()).backward()
                grads = {n: p.grad.full_tensor().numpy().copy() for n, p in learner.model.named_parameters()
                         if p.grad is not None}  # numpy: a torch tensor would go through shared memory
                results[(reshard, chunk)] = (logp.detach().numpy(), entropy.detach().numpy(), ref.numpy(), grads)
        tied = learner.model.get_output_embeddings().weight is learner.model.get_input_embeddings().weight
        out.put((rank, results, tied))
    finally:
        learner.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_under_a_two_rank_fsdp_learner_equal_the_whole_logits(tiny_model, dtype):
    """Both ranks run different numbers of chunks; the root unit is kept unsharded after its forward
    (FSDP's default) or resharded, with the reference's forward between the policy's forward and its
    backward, as the trainer runs them; bf16 is the learner's mixed precision (bf16 head and hidden
    states, log-softmax in float32)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    url = f"tcp://127.0.0.1:{_port()}"
    procs = [ctx.Process(target=as_rank, args=(_fsdp_rank, r, tiny_model, dtype, url, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {r: (res, tied) for r, res, tied in (out.get(timeout=240) for _ in procs)}
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0], "a rank failed"
    results = {r: ({key: tuple(torch.from_numpy(a) for a in value[:3]) + ({n: torch.from_numpy(g) for n, g in
                                                                         value[3].items()},)
                    for key, value in res.items()}, tied) for r, (res, tied) in results.items()}
    tol = 1e-5 if dtype == "float32" else 2e-2
    for rank, (res, tied) in results.items():
        assert tied, "the output head is no longer tied to the embeddings"
        whole = res[(False, 0)]
        assert whole[3] and all("lora_" in n for n in whole[3])
        for key in [(False, 5), (True, 0), (True, 5)]:
            for a, b in zip(whole[:3], res[key][:3]):
                close(b, a, rtol=1e-6, atol=1e-6)
            for n, grad in whole[3].items():  # bf16: gradients through a bf16 head, rounded by kernel and shape
                close(res[key][3][n], grad, rtol=tol, atol=tol * float(grad.abs().max()))
    # gradients are the sum over both ranks' data: every rank holds the same full gradient
    for n, grad in results[0][0][(True, 5)][3].items():
        close(results[1][0][(True, 5)][3][n], grad, rtol=0, atol=0)


def test_target_logprobs_score_any_given_token_per_position():
    model = _lora_model()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, 100, (2, 9), generator=g)
    targets = torch.randint(4, 100, (2, 9), generator=g)  # not the next tokens
    attention = torch.ones_like(tokens)
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=attention).logits  # [2, 9, V]
        expect = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
        for chunk in (3, 1024):
            close(target_logprobs(model, tokens, targets, attention, chunk=chunk), expect, rtol=1e-5, atol=1e-5)
        # with the next tokens as targets they are the model's log-probs, shifted by one
        nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
        close(target_logprobs(model, tokens, nxt, attention)[:, :-1], model_terms(model, tokens, attention)[0][:, 1:],
              rtol=1e-5, atol=1e-5)


def test_negative_chunk_or_token_budget_is_refused_with_the_flag_to_change():
    from learner.config import LearnerConfig

    with pytest.raises(ValueError, match="--learner.logit-chunk"):
        LearnerConfig(logit_chunk=-1)
    with pytest.raises(ValueError, match="--learner.micro-batch-tokens"):
        LearnerConfig(micro_batch_tokens=-5)
    assert LearnerConfig(logit_chunk=0, micro_batch_tokens=0).logit_chunk == 0  # 0: off, today's paths
