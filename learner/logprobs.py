"""Per-token log-probs and entropy of a causal LM, chunk by chunk from its last hidden state.

The full-vocabulary logits of a micro-batch are its largest tensors: [b, T, V] with V = 151,936
for Qwen, in float32 for the log-softmax, and several copies of them live through a backward
(the logits, the log-softmax the backward keeps, the entropy's terms, their gradients). With
2,048 tokens each copy is 1.2 GB. Here the model stops at the last hidden state [b, T, H]
(`logits_to_keep=1`: the head runs on one position only); the output head, the log-softmax at
the temperature, the picked token's log-prob and the entropy then run over `chunk` token
positions at a time, each chunk under activation checkpointing, so the backward recomputes a
chunk's logits rather than keeping them. At most one chunk's [chunk, V] tensors exist at once.

Values and gradients are those of the whole-logits path (`token_logprobs` / `token_entropy` of
learner/losses.py, which `chunk=0` keeps): the same log-softmax per position, the same head.

Design decisions:
- The head is called as the model's module (`get_output_embeddings()`), not copied into a
  weight: a head tied to the input embeddings stays tied, and an adapter on it would apply.
- Under FSDP2 the head's weight belongs to the root unit, unsharded in the root's forward and
  possibly resharded after it; the trainer passes a head that unshards the root first
  (learner/trainer.py `_head`), which is a no-op, without a collective, when it already is.
- The entropy is a metric unless its coefficient is above 0: then, and only then, it carries
  a gradient (`entropy_grad`); otherwise it is computed without building a graph over [c, V].
- `banned` tokens (a vision-language model's image placeholders, which the engines never
  sample) get probability zero, as in the engines' sampling distribution: their logits are
  set to a large negative number (finite, so the entropy's p·log p stays 0, not NaN).
- `pixels` (a vision-language model's pixel inputs for the rows, policy/vision.py, with the
  rows' M-RoPE `position_ids` for a family that has them) go to the model's forward with the
  tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from learner.losses import token_entropy, token_logprobs

Head = Callable[[torch.Tensor], torch.Tensor]
"""The output head: hidden states [..., H] -> logits [..., V]."""

NEVER = -1e30
"""The logit of a banned token: exp of it is 0, and it stays finite after subtracting a max."""


def _ban(z: torch.Tensor, banned: tuple[int, ...]) -> torch.Tensor:
    if not banned:
        return z
    keep = torch.ones(z.shape[-1], dtype=torch.bool, device=z.device)
    keep[list(banned)] = False
    return z.masked_fill(~keep, NEVER)


def _chunk_terms(hidden: torch.Tensor, target: torch.Tensor, head: Head, temperature: float,
                 entropy: bool, entropy_grad: bool, banned: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: hidden [c, H], target [c] (the token each position predicts) -> (log-prob [c],
    entropy [c], zeros when not asked for)."""
    z = _ban(head(hidden).float(), banned)  # [c, V]
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)  # [c, V]
    del z
    picked = logp.gather(-1, target[:, None]).squeeze(-1)  # [c]
    if not entropy:
        return picked, torch.zeros_like(picked)
    if entropy_grad:
        return picked, -(logp.exp() * logp).sum(-1)
    with torch.no_grad():  # a metric: one [c, V] temporary, no graph
        return picked, -logp.exp().mul_(logp).sum(-1)


def chunked_terms(hidden: torch.Tensor, head: Head, tokens: torch.Tensor, temperature: float = 1.0,
                  chunk: int = 1024, entropy: bool = False, entropy_grad: bool = False,
                  banned: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(tokens[:, t] | tokens[:, :t]) and the entropy of π(· | tokens[:, :t]), aligned to the
    predicted token as `losses.token_logprobs` and `losses.token_entropy` are.

    hidden: [b, T, H] the last hidden state (after the final norm) for inputs tokens [b, T];
    head: the output head. Returns (logp [b, T], entropy [b, T] or None without `entropy`);
    entry 0 of a row (no prediction) is 0. The b·(T − 1) predicting positions are cut into
    chunks of `chunk`; with grad enabled each chunk is checkpointed (the backward recomputes its
    logits). The entropy carries a gradient only with `entropy_grad`.
    """
    assert chunk > 0, "chunk is a number of token positions"
    b, t, h = hidden.shape
    flat = hidden[:, :-1].reshape(-1, h)  # [N, H], N = b·(T − 1): position t predicts token t + 1
    target = tokens[:, 1:].reshape(-1)  # [N]
    grad = torch.is_grad_enabled() and hidden.requires_grad
    logps, entropies = [], []
    for s in range(0, flat.shape[0], chunk):
        args = (flat[s:s + chunk], target[s:s + chunk], head, temperature, entropy, entropy_grad and grad, banned)
        if grad:
            lp, ent = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_terms(*args)
        logps.append(lp)
        entropies.append(ent)

    def rows(parts: list[torch.Tensor]) -> torch.Tensor:
        out = torch.cat(parts).view(b, t - 1)  # [b, T-1]
        return torch.cat([torch.zeros_like(out[:, :1]), out], dim=1)  # [b, T]

    if not logps:  # T = 1: nothing is predicted
        zeros = hidden.new_zeros((b, t), dtype=torch.float32)
        return zeros, (zeros if entropy else None)
    return rows(logps), (rows(entropies) if entropy else None)


def model_terms(model, tokens: torch.Tensor, attention: torch.Tensor, temperature: float = 1.0,
                chunk: int = 1024, entropy: bool = False, entropy_grad: bool = False,
                head: Head | None = None, pixels: dict | None = None,
                banned: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log π [b, T], entropy [b, T] or None) of a Hugging Face causal LM or vision-language
    model (PEFT-wrapped or not) on tokens [b, T] with attention [b, T] (and the rows' `pixels`):
    chunked from the last hidden state, or with `chunk` 0 from the whole logits
    (`losses.token_logprobs`, `losses.token_entropy`). `head` defaults to the model's output
    embeddings; `banned` tokens have probability zero."""
    pixels = pixels or {}
    if chunk == 0:
        logits = _ban(model(input_ids=tokens, attention_mask=attention, **pixels).logits, banned)  # [b, T, V]
        logp = token_logprobs(logits, tokens, temperature)
        if not entropy:
            return logp, None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logp, token_entropy(logits, temperature)
    # hidden_states[-1] is the last hidden state after the final norm (transformers ties it to
    # last_hidden_state); logits_to_keep=1 has the model's own head run on one position only.
    out = model(input_ids=tokens, attention_mask=attention, output_hidden_states=True, logits_to_keep=1, **pixels)
    hidden = out.hidden_states[-1]  # [b, T, H]
    head = head if head is not None else model.get_output_embeddings()
    return chunked_terms(hidden, head, tokens, temperature, chunk, entropy, entropy_grad, banned)


def target_logprobs(model, inputs: torch.Tensor, targets: torch.Tensor, attention: torch.Tensor,
                    chunk: int = 1024, head: Head | None = None) -> torch.Tensor:
    """log π(targets[:, t] | inputs[:, :t + 1]) [b, T]: each position's log-prob of a token given
    per position (the Tinker API's `target_tokens`, which need not be the next input token), by the
    same chunked head and log-softmax as `model_terms`. inputs, targets, attention: [b, T]."""
    out = model(input_ids=inputs, attention_mask=attention, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1]  # [b, T, H]
    # chunked_terms scores tokens[:, t + 1] from hidden[:, t]: shift the targets right by one and
    # give the hidden states one unused last position.
    hidden = torch.cat([hidden, hidden[:, -1:]], dim=1)  # [b, T + 1, H]
    shifted = torch.cat([targets[:, :1], targets], dim=1)  # [b, T + 1]
    head = head if head is not None else model.get_output_embeddings()
    logp, _ = chunked_terms(hidden, head, shifted, chunk=chunk)
    return logp[:, 1:]
