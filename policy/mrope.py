"""Multimodal rotary positions (M-RoPE) of the Qwen-VL families: three position ids a token
(time, height, width).

A text token's three ids are equal and count on from the token before it. An image's tokens
(`grid_h·grid_w / merge²` of them, row-major over the merged patch grid) start at the position
`p` where the image begins: time `p`, height `p + row`, width `p + column`; the text after the
image resumes at `p + max(rows, columns)`. This is `get_rope_index` of transformers' Qwen2-VL,
Qwen2.5-VL and Qwen3-VL models for still images (tests/policy/test_qwen_vl.py pins it against
the model's own).

So the positions of a sequence are those of any prefix that ends outside an image followed by
the rest's own positions shifted by the prefix's next position (its largest id + 1): an engine
that feeds a row turn by turn computes each turn's positions alone and adds the row's offset.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]],
                    merge: int) -> torch.Tensor:
    """Positions [3, len(ids)] (int64) of `ids` starting at 0, the i-th run of image tokens
    taking `grids[i]` = (t, h, w) in patches; AssertionError when the runs and grids disagree."""
    ids = torch.as_tensor(list(ids), dtype=torch.long)
    out = torch.empty((3, len(ids)), dtype=torch.long)
    is_image = (ids == image_token_id).tolist()
    at, pos, grid = 0, 0, iter(grids)
    while at < len(ids):
        if not is_image[at]:
            end = at
            while end < len(ids) and not is_image[end]:
                end += 1
            out[:, at:end] = torch.arange(pos, pos + end - at)
            pos += end - at
            at = end
            continue
        t, h, w = (int(x) for x in next(grid))
        h, w = h // merge, w // merge
        n = t * h * w
        assert all(is_image[at:at + n]) and len(is_image[at:at + n]) == n, "an image's tokens do not fill its grid"
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out[:, at:at + n] = torch.stack([tt, hh, ww]).reshape(3, n) + pos
        pos += max(h, w)
        at += n
    assert next(grid, None) is None, "more grids than images in the token ids"
    return out


def next_position(positions: torch.Tensor, start: int = 0) -> int:
    """The position the token after `positions` [3, T] takes (`start` when T is 0)."""
    return int(positions.max()) + 1 if positions.numel() else start
