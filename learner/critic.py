"""PPO's value head: a linear map from the critic's last hidden state to a scalar.

It is zero-initialised, so the critic starts by predicting 0 for every prefix and
the first advantages are the returns themselves. It returns a fresh tensor (not
a view of the projection), so FSDP's pre-backward hook on its output is safe.
"""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    def __init__(self, hidden: int, device=None) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, 1, device=device)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T] float32: the value of the prefix ending at each position."""
        return self.proj(hidden_states).float().squeeze(-1).clone()
