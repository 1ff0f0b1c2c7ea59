"""PPO's critic: a second LoRA adapter on the policy's frozen base, and a value head.

The value head is a linear map from the critic's last hidden state to a scalar. It
is zero-initialised, so the critic starts by predicting 0 for every prefix and the
first advantages are the returns themselves. It returns a fresh tensor (not a view
of the projection), so FSDP's pre-backward hook on its output is safe.

The critic's forward routes the LoRA layers through its adapter (`route`) rather
than PEFT's `set_adapter`, which would also freeze every other adapter
(requires_grad=False) on each switch; the route changes nothing else.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def route(lora_layers: list, name: str):
    """Route `lora_layers` (PEFT's BaseTunerLayer modules) through adapter `name` inside the block."""
    before = [m._active_adapter for m in lora_layers]
    for m in lora_layers:
        m._active_adapter = [name]
    try:
        yield
    finally:
        for m, b in zip(lora_layers, before):
            m._active_adapter = b


def critic_values(model, value_head: "ValueHead", lora_layers: list, adapter: str, tokens: torch.Tensor,
                  attention: torch.Tensor, pixels: dict | None = None) -> torch.Tensor:
    """V(s_t) for the action at t, aligned like losses.token_logprobs: [b, T] (entry 0 is 0);
    `pixels`: a vision-language model's pixel inputs for the rows."""
    with route(lora_layers, adapter):  # logits_to_keep=1: no [b, T, V] logits, only the hidden states are used
        out = model(input_ids=tokens, attention_mask=attention, output_hidden_states=True, logits_to_keep=1,
                    **(pixels or {}))
    v = value_head(out.hidden_states[-1])  # [b, T]: value of the prefix ending at t
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


class ValueHead(torch.nn.Module):
    def __init__(self, hidden: int, device=None) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, 1, device=device)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T] float32: the value of the prefix ending at each position."""
        return self.proj(hidden_states).float().squeeze(-1).clone()
