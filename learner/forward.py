"""The learner's forward passes over a batch: log π (current and reference), V for PPO's
critic, the start-of-step quantities over all of a rank's rows, each micro-batch's inputs
(tokens, attention, pictures) and the plan of micro-batches with their shares of the loss.

`Forward` is the part of `Learner` (learner/trainer.py) that reads a batch and runs the model
without changing it; the step, the optimizer and publishing stay there. It uses the learner's
`model`, `value_head`, `critic_params`, `_lora_layers`, `cfg`, `scheme`, `temperature` and
`device`, set up by `Learner.setup`.
"""

from __future__ import annotations

from learner.config import CRITIC


class Forward:
    """The forward passes of one FSDP rank (mixed into `Learner`)."""

    def _head(self, hidden):
        """The output head on hidden states [c, H] -> logits [c, V], for learner/logprobs.py. The
        head's weight is the root FSDP unit's: unshard it first. That is a no-op (no collective)
        while it is unsharded, as it stays from the root's forward to its backward unless resharded
        after forward; the backward's recomputation of a chunk passes here too."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self.model.unshard()
        return self.model.get_output_embeddings()(hidden)

    def _policy_terms(self, tokens, attention, pixels, entropy: bool = False):
        """(log π [b, T], entropy [b, T] or None) of the current model state, chunked by
        --learner.logit-chunk (learner/logprobs.py); the entropy has grad when its coefficient is
        above 0. Image placeholder tokens have probability zero, as where they were sampled."""
        from learner.logprobs import model_terms

        return model_terms(self.model, tokens, attention, self.temperature, self.cfg.logit_chunk, entropy=entropy,
                           entropy_grad=entropy and self.cfg.entropy_coef > 0, head=self._head, pixels=pixels,
                           banned=self.scheme.special_ids if self.scheme is not None else ())

    def _ref_logprobs(self, tokens, attention, pixels):
        """log π_ref: the same model with the adapter disabled (no second copy in memory)."""
        import torch

        with torch.no_grad(), self.model.disable_adapter():
            logp, _ = self._policy_terms(tokens, attention, pixels)
        # PEFT re-enables adapters by marking only the active one trainable: restore the critic's flags.
        for p in self.critic_params:
            p.requires_grad_(True)
        return logp

    def _values(self, tokens, attention, pixels):
        """V(s_t) for the action at t: [b, T] (learner/critic.py)."""
        from learner.critic import critic_values

        return critic_values(self.model, self.value_head, self._lora_layers, CRITIC, tokens, attention, pixels)

    def _old_logprobs(self, tokens, attention, pixels):
        return self._policy_terms(tokens, attention, pixels)[0]

    def _forward_all(self, batch, rows: list[int], fn):
        """`fn` over `rows` without grad, in micro-batches, into a [B, T] tensor (start-of-step
        quantities: π_old, V_old). Ranks run the same number of forward passes."""
        import torch

        out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        with torch.no_grad():
            for chunk, share in self._plan(batch, rows, shares=False):
                tokens, attention, pixels, width = self._inputs(batch, chunk)
                value = fn(tokens, attention, pixels).float().cpu()
                if share:
                    out[torch.tensor(chunk), :width] = value
        return out

    def _inputs(self, batch, chunk):
        """(tokens, attention, pixel inputs, width) of the rows `chunk`, cut to their longest. The
        pixel inputs carry the rows' M-RoPE positions for a family that has them (policy/vision.py)."""
        import torch

        from policy.vision import batch_positions

        rows = torch.tensor(chunk)
        width = int(batch.attention[rows].sum(1).max())
        tokens = batch.tokens[rows, :width]
        pixels = {}
        if batch.images is not None:
            if self.scheme is None:
                raise ValueError(f"the learner's model {self.model_path} is a text model, but the batch holds images")
            images = [batch.images[r] for r in chunk]
            pixels = self.scheme.pixels(images, self.device)
            positions = batch_positions(self.scheme, tokens, batch.attention[rows].sum(1).tolist(), images)
            if positions is not None:
                pixels["position_ids"] = positions.to(self.device)
        return tokens.to(self.device), batch.attention[rows, :width].to(self.device), pixels, width

    def _plan(self, batch, rows: list[int], shares: bool = True) -> list[tuple[list[int], float]]:
        """Micro-batches of `rows` (--learner.micro-batch rows each, or as many as fit
        --learner.micro-batch-tokens) with each one's share of the rank's loss, so that accumulation
        equals one pass over the rank's whole batch (learner/plan.py). FSDP's collectives run once
        per forward/backward, so every rank runs as many micro-batches as the busiest one; the
        extra ones repeat a row with share 0."""
        import torch
        import torch.distributed as dist

        from learner import plan

        if self.cfg.micro_batch_tokens:
            lengths = batch.attention.sum(1).tolist()
            chunks = plan.token_micro_batches(rows, lengths, self.cfg.micro_batch_tokens)
        else:
            chunks = plan.micro_batches(rows, self.cfg.micro_batch)
        weights = (plan.shares(chunks, batch.mask, self.cfg.aggregation, self.cfg.mini_batches) if shares
                   else [1.0] * len(chunks))
        count = torch.tensor([len(chunks)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(chunks) < max(int(count), 1):  # at least one: every rank reports the same metrics
            chunks.append((rows or [0])[:1])
            weights.append(0.0)
        return list(zip(chunks, weights))
