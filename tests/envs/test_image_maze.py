"""The maze as a picture: what the picture shows, what the text leaves out, the blank control,
determinism and the held-out evaluation set."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from envs import make_env
from envs.image_maze import BLANK, COLOURS, RULES, ImageMazeEnv, render_image
from envs.maze import MAZE64_SEED, Maze, MazeEnv, maze_set, shortest_path

NAMES = {v: k for k, v in COLOURS.items()}


def corridor() -> Maze:
    # @ . #
    # # . G
    walls = ((False, False, True), (True, False, False))
    return Maze(walls, start=(0, 0), goal=(1, 2))


def text_and_picture(obs) -> tuple[str, np.ndarray]:
    (message,) = obs
    text, image = message["content"]
    assert message["role"] == "user" and text["type"] == "text" and image["type"] == "image"
    return text["text"], image["image"]


def read_back(picture: np.ndarray, cell_px: int = 16) -> list[list[tuple[str, str]]]:
    """Each cell as (centre, edge) colour names: the square drawn on it and its floor."""
    h, w = picture.shape[0] // cell_px, picture.shape[1] // cell_px
    return [[(NAMES[tuple(picture[r * cell_px + cell_px // 2, c * cell_px + cell_px // 2])],
              NAMES[tuple(picture[r * cell_px, c * cell_px])]) for c in range(w)] for r in range(h)]


@pytest.mark.parametrize("kwargs", [{}, {"hints": True}, {"blank": True}, {"cell_px": 8, "size": 5}])
def test_gymnasium_env_checker_passes(kwargs):
    env = make_env("image-maze", **kwargs)
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert obs in env.observation_space


def test_registered_with_gymnasium():
    assert "tandem/image-maze-v0" in gym.registry
    env = make_env("image-maze", size=5)
    assert isinstance(env, ImageMazeEnv) and env.size == 5


def test_colours_are_distinct():
    assert len(set(COLOURS.values()) | {BLANK}) == len(COLOURS) + 1


def test_the_picture_shows_walls_agent_goal_and_trail():
    env = ImageMazeEnv(size=3)
    text, picture = text_and_picture(env.reset(options={"maze": corridor()})[0])
    assert picture.shape == (32, 48, 3) and picture.dtype == np.uint8
    assert read_back(picture) == [[("agent", "trail"), ("open", "open"), ("wall", "wall")],
                                  [("wall", "wall"), ("open", "open"), ("goal", "open")]]
    _, bumped = text_and_picture(env.step("up")[0])  # into the edge: the same picture
    assert np.array_equal(bumped, picture)
    env.step("right")
    _, picture = text_and_picture(env.step("down")[0])
    assert read_back(picture) == [[("trail", "trail"), ("trail", "trail"), ("wall", "wall")],
                                  [("wall", "wall"), ("agent", "trail"), ("goal", "open")]]
    obs, reward, terminated, *_ = env.step("right")
    assert (reward, terminated) == (1.0, True)
    assert read_back(text_and_picture(obs)[1])[1] == [("wall", "wall"), ("trail", "trail"), ("agent", "goal")]


def test_every_cell_is_drawn_from_its_own_state_alone():
    # Cells in the same state have identical pixels wherever they are, so one 16x16 patch holds
    # exactly one cell's state.
    for maze in maze_set(5, 10, 5, 0.3, 3):
        env = ImageMazeEnv(size=5)
        env.reset(options={"maze": maze})
        for move in shortest_path(maze)[:-1]:
            obs, *_ = env.step(move)
        picture = text_and_picture(obs)[1]
        blocks: dict[tuple, bytes] = {}
        for r in range(5):
            for c in range(5):
                state = ("agent" if (r, c) == env.pos else "goal" if (r, c) == maze.goal else
                         "wall" if maze.walls[r][c] else "trail" if (r, c) in env.visited else "open")
                block = picture[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16].tobytes()
                assert blocks.setdefault(state, block) == block, state


def test_render_image_scales_with_cell_px():
    maze = corridor()
    for cell_px in (1, 4, 16):
        picture = render_image(maze, maze.start, {maze.start}, cell_px)
        assert picture.shape == (2 * cell_px, 3 * cell_px, 3)
        assert read_back(picture, cell_px)[1][0][0] == "wall"
    # Below 4 pixels the squares fill their cells.
    assert tuple(render_image(maze, maze.start, {maze.start}, 1)[0, 0]) == COLOURS["agent"]


def test_the_text_holds_no_state_by_default():
    env = ImageMazeEnv(size=3, max_steps=10)
    texts = [text_and_picture(env.reset(options={"maze": corridor()})[0])[0]]
    for move in ["down", "go", "right", "left"]:
        texts.append(text_and_picture(env.step(move)[0])[0])
    assert texts == [f"{RULES}\nstart", "wall down", "invalid", "moved", "moved"]
    for seed in range(20):
        text = text_and_picture(env.reset(seed=seed)[0])[0]
        assert text == f"{RULES}\nstart"
        for move in ["up", "left", "down", "right"]:
            assert text_and_picture(env.step(move)[0])[0] in {"moved", f"wall {move}"}


def test_hints_add_the_text_mazes_lines():
    image, text = ImageMazeEnv(size=3, hints=True), MazeEnv(size=3)
    got = text_and_picture(image.reset(options={"maze": corridor()})[0])[0]
    want = text.reset(options={"maze": corridor()})[0][0]["content"]
    assert got == f"{RULES}\n" + "\n".join(want.split("\n")[:4])
    assert got.endswith("start\ngoal: down right right\nopen: right\nnew: right")
    for move in ["down", "right", "left"]:
        got = text_and_picture(image.step(move)[0])[0]
        assert got == "\n".join(text.step(move)[0][0]["content"].split("\n")[:4])
    assert got == "moved\ngoal: down right right\nopen: right\nnew: none"


def test_blank_pictures_are_one_constant_image_whatever_the_maze():
    env, seen = ImageMazeEnv(blank=True), ImageMazeEnv()
    first = text_and_picture(env.reset(seed=0)[0])[1]
    assert first.shape == text_and_picture(seen.reset(seed=0)[0])[1].shape
    assert np.all(first == np.array(BLANK, np.uint8))
    for seed in range(1, 30):
        assert np.array_equal(text_and_picture(env.reset(seed=seed)[0])[1], first)
        for move in ["up", "right", "down", "left"]:
            assert np.array_equal(text_and_picture(env.step(move)[0])[1], first)
    assert np.array_equal(text_and_picture(env.reset(options={"maze": maze_set(1, 1, 4, 0.3, 3)[0]})[0])[1], first)


def test_a_seed_decides_the_task():
    a, b = ImageMazeEnv(), ImageMazeEnv()
    pictures = set()
    for seed in range(10):
        pa, pb = text_and_picture(a.reset(seed=seed)[0])[1], text_and_picture(b.reset(seed=seed)[0])[1]
        assert np.array_equal(pa, pb)
        pictures.add(pa.tobytes())
        for move in ["up", "left", "down"]:
            assert np.array_equal(text_and_picture(a.step(move)[0])[1], text_and_picture(b.step(move)[0])[1])
    assert len(pictures) == 10
    # The same seed gives the same maze as the text maze.
    text = MazeEnv()
    text.reset(seed=7)
    a.reset(seed=7)
    assert a.maze == text.maze


def test_the_evaluation_set_is_maze64_and_training_never_draws_it():
    env = ImageMazeEnv()
    assert env.eval_seed == MAZE64_SEED == MazeEnv().eval_seed
    tasks = env.eval_tasks(env.eval_seed, 64)
    assert [t["maze"] for t in tasks] == [t["maze"] for t in MazeEnv().eval_tasks(MAZE64_SEED, 64)]
    keys = {t["maze"].key() for t in tasks}
    pictures = {text_and_picture(env.reset(options=t)[0])[1].tobytes() for t in tasks}
    assert len(keys) == len(pictures) == 64
    for seed in range(1500):
        picture = text_and_picture(env.reset(seed=seed)[0])[1]
        assert env.maze.key() not in keys and picture.tobytes() not in pictures


def test_rewards_and_step_limit_are_the_text_mazes():
    for maze in maze_set(3, 10, 4, 0.3, 3):
        env = ImageMazeEnv()
        env.reset(options={"maze": maze})
        for move in shortest_path(maze):
            _, reward, terminated, truncated, _ = env.step(move)
        assert (reward, terminated, truncated) == (1.0, True, False)
    env = ImageMazeEnv(size=3, max_steps=2)
    env.reset(options={"maze": corridor()})
    assert env.step("left")[1:4] == (0.0, False, False)
    assert env.step("left")[1:4] == (0.0, False, True)


def test_curriculum_sizes_the_picture():
    env = ImageMazeEnv(curriculum="3@0,5@10")
    assert text_and_picture(env.reset(seed=0, options={"policy_version": 0})[0])[1].shape == (48, 48, 3)
    assert text_and_picture(env.reset(seed=0, options={"policy_version": 12})[0])[1].shape == (80, 80, 3)


@pytest.mark.parametrize("kwargs, match", [
    ({"cell_px": 0}, "positive whole number"),
    ({"cell_px": -16}, "positive whole number"),
    ({"cell_px": 2.5}, "positive whole number"),
    ({"cell_px": True}, "positive whole number"),
    ({"cell_px": 300}, "1200 pixels a side, over MAX_IMAGE_SIDE = 1024: lower cell_px"),
    ({"curriculum": "4@0,70@5"}, "70x70 maze at cell_px=16"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageMazeEnv(**kwargs)
