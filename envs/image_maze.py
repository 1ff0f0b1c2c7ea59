"""The maze of envs/maze.py shown as a picture: the task for vision-language policies.

Design decisions:
- Same mazes, sizes, curriculum, step limit and sparse reward as `MazeEnv` (a
  subclass), and the same evaluation set: image-maze-64 is maze-64's 64 mazes,
  which training resets never draw, so the two environments' scores compare.
- One cell is 16 pixels a side (`cell_px`) and every cell's pixels depend on that
  cell's state alone (wall, open, visited, agent, goal), each state its own
  colour. A vision tower that cuts the picture into 16-pixel patches then sees
  one cell per image token, and nothing spills between tokens; a 4×4 maze is a
  64×64 picture, 16 patches.
- The text holds no state: the opening is a short rules line and `start`, later
  turns only what the last move did, worded as in the text maze (`moved`,
  `wall up`, `invalid`), so the policy must read the maze from the picture.
  `hints=True` adds the text maze's goal/open/new lines, for experiments.
- `blank=True` is the control: every picture is the same grey image of the same
  size, so nothing about the maze reaches the model but the bump reports. The
  gap between it and the real pictures is what the model learns from seeing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from envs.base import MAX_IMAGE_SIDE
from envs.maze import MAZE64_SEED, Maze, MazeEnv

COLOURS = {
    "wall": (40, 40, 40),       # near black
    "open": (255, 255, 255),    # white
    "trail": (150, 190, 255),   # light blue: visited this episode
    "agent": (220, 40, 40),     # red square, inset on its cell
    "goal": (40, 170, 60),      # green square, inset on its cell
}
"""RGB of each cell state in `render_image`."""

BLANK = (128, 128, 128)
"""The one colour of every picture with `blank=True`."""

RULES = "Reach the green goal. Reply with one move: up, down, left or right."
"""The opening observation's first line (short: the built-in tokenizer spends a token a character)."""


def render_image(maze: Maze, pos: tuple[int, int], visited: Iterable[tuple[int, int]],
                 cell_px: int = 16) -> np.ndarray:
    """The maze as an RGB uint8 picture of shape (H * cell_px, W * cell_px, 3): walls, open
    cells and `visited` cells (the trail) fill their cells; the agent at `pos` and the goal are
    squares inset by a quarter cell on their cell's floor (trail under the agent, the goal's green
    once the agent stands on it)."""
    h, w = maze.shape
    floor = np.empty((h, w, 3), np.uint8)
    floor[:] = COLOURS["open"]
    floor[np.array(maze.walls, dtype=bool)] = COLOURS["wall"]
    for r, c in visited:
        floor[r, c] = COLOURS["trail"]
    floor[pos] = COLOURS["goal"] if pos == maze.goal else COLOURS["trail"]
    image = np.repeat(np.repeat(floor, cell_px, axis=0), cell_px, axis=1)
    inset = cell_px // 4
    squares = [(pos, "agent")] if pos == maze.goal else [(maze.goal, "goal"), (pos, "agent")]
    for (r, c), name in squares:
        image[r * cell_px + inset:(r + 1) * cell_px - inset, c * cell_px + inset:(c + 1) * cell_px - inset] = \
            COLOURS[name]
    return image


class ImageMazeEnv(MazeEnv):
    """Reach the goal from a picture of the maze; reward 1.0 at the goal.

    Every observation is one user message, `[{"type": "text", "text": ...},
    {"type": "image", "image": picture}]`: the text is `RULES` and "start" at reset,
    then the last move's status; the picture is `render_image` (or a constant grey
    image with `blank`). Resets, options and the evaluation set are `MazeEnv`'s.
    """

    shows_images = True

    def __init__(self, size: int = 4, wall_density: float = 0.3, min_path: int = 3,
                 max_steps: int = 12, curriculum: str = "", hints: bool = False, blank: bool = False,
                 cell_px: int = 16) -> None:
        super().__init__(size, wall_density, min_path, max_steps, curriculum)
        if isinstance(cell_px, bool) or not isinstance(cell_px, int) or cell_px < 1:
            raise ValueError(f"cell_px must be a positive whole number of pixels, got {cell_px!r}")
        largest = max([size] + [s for _, s in self.curriculum])
        if largest * cell_px > MAX_IMAGE_SIDE:
            raise ValueError(f"a {largest}x{largest} maze at cell_px={cell_px} is {largest * cell_px} pixels "
                             f"a side, over MAX_IMAGE_SIDE = {MAX_IMAGE_SIDE}: lower cell_px")
        self.hints, self.blank, self.cell_px = bool(hints), bool(blank), cell_px

    eval_seed = MAZE64_SEED

    def _observe(self, status: str) -> list[dict[str, Any]]:  # type: ignore[override]
        assert self.maze is not None
        lines = [RULES, status] if status == "start" else [status]
        if self.hints:
            lines.append(self.hint_lines())
        if self.blank:
            h, w = self.maze.shape
            picture = np.full((h * self.cell_px, w * self.cell_px, 3), BLANK, np.uint8)
        else:
            picture = render_image(self.maze, self.pos, self.visited, self.cell_px)
        content = [{"type": "text", "text": "\n".join(lines)}, {"type": "image", "image": picture}]
        return [{"role": "user", "content": content}]
