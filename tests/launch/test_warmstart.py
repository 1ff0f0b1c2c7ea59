"""The image maze's warm start, as the launcher builds it: its perception exercises say in words
exactly what their picture shows, and its score counts only replies greedy decoding would write."""

import numpy as np
import pytest
import torch

from envs.image_maze import ImageMazeEnv, render_image
from envs.maze import MazeEnv
from launch.warmstart import (LOOK, WarmstartConfig, _train_step, demonstration, description, exact_replies,
                              perceive, reply_ids)


def test_a_description_is_the_text_mazes_lines_for_the_state_in_its_picture(vlm_chat):
    env, text = ImageMazeEnv(), MazeEnv()
    walked = 0
    for seed in range(40):
        tokens, mask, images = description(env, vlm_chat, seed)
        assert len(tokens) == len(mask) and len(images) == 1
        reply = [t for t, m in zip(tokens, mask) if m]
        assert mask == [0] * (len(tokens) - len(reply)) + [1] * len(reply)
        assert reply[-1] == vlm_chat.stop_ids[0]
        # the picture is the state the reply describes ...
        np.testing.assert_array_equal(images[0], render_image(env.maze, env.pos, env.visited))
        lines = vlm_chat.decode(reply[:-1])
        assert lines == env.hint_lines()
        # ... worded as the text maze words that state
        text.reset(options={"maze": env.maze})
        text.pos, text.visited = env.pos, env.visited
        assert lines == text.hint_lines()
        walked += env.pos != env.maze.start
        prompt = tokens[: len(tokens) - len(reply)]
        picture = [{"role": "user", "content": [{"type": "text", "text": LOOK}, {"type": "image", "image": images[0]}]}]
        assert prompt == vlm_chat.prompt_ids(picture)
    assert walked > 10  # most pictures show the agent away from its start, with a trail
    assert description(env, vlm_chat, 3)[0] == description(env, vlm_chat, 3)[0]


@pytest.mark.parametrize("read", [False, True])
def test_an_exercise_inside_an_episode_asks_about_the_newest_picture_after_the_episode_as_the_policy_saw_it(
        vlm_chat, read):
    """The context is the episode token for token (the opening, each move, each observation with
    its picture; with `read` each move after its reading, as the demonstrations write it); the
    `look` message, holding the newest picture, takes the last observation's place; the reply is
    that state's lines."""
    from envs.maze import parse_move
    from policy.chat import message_images

    env, replay = ImageMazeEnv(), ImageMazeEnv()
    stop = vlm_chat.stop_ids[0]
    for seed in range(30):
        tokens, mask, images = description(env, vlm_chat, seed, in_episode=True, read=read)
        reply = [t for t, m in zip(tokens, mask) if m]
        assert mask == [0] * (len(tokens) - len(reply)) + [1] * len(reply)
        assert vlm_chat.decode(reply[:-1]) == env.hint_lines()
        # replay the episode through the chat as an actor renders it, reading the moves back
        messages, _ = replay.reset(seed=seed)
        want, pictures = vlm_chat.prompt_ids(messages), message_images(messages)
        while True:
            move = parse_move(vlm_chat.decode(tokens[len(want):tokens.index(stop, len(want))]))
            want += reply_ids(replay, vlm_chat, move, read)
            messages, _, terminated, _, _ = replay.step(move)
            look = [{"role": "user", "content": [{"type": "text", "text": LOOK},
                                                  {"type": "image", "image": message_images(messages)[-1]}]}]
            if terminated or want + vlm_chat.observation_ids(look) == tokens[: len(tokens) - len(reply)]:
                break
            want, pictures = want + vlm_chat.observation_ids(messages), pictures + message_images(messages)
        assert want + vlm_chat.observation_ids(look) == tokens[: len(tokens) - len(reply)]
        assert len(images) == len(pictures) + 1 >= 2
        for got, expected in zip(images, pictures + message_images(look)):
            np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(images[-1], render_image(env.maze, env.pos, env.visited))


@pytest.mark.parametrize("read", [True, False])
def test_a_demonstrated_reply_is_the_oracles_move_after_the_reading_of_its_four_neighbours(vlm_chat, read):
    """Play each demonstration's replies back in a fresh image maze, as the environment reads them:
    each is the first move of a shortest path from where the agent stands (the digits passed over,
    so the episode solves the maze in the fewest moves), and with `read` its four digits before a
    space say of up, down, left and right what the text maze's lines say: 0 not open, 1 open onto
    the trail, 2 open onto a cell not visited yet."""
    from envs.maze import MOVES, parse_move, shortest_path

    env, replay = ImageMazeEnv(), ImageMazeEnv()
    stop, seen = vlm_chat.stop_ids[0], set()
    for seed in range(20):
        tokens, mask, _ = demonstration(env, vlm_chat, seed, noise=0.0, read=read)
        replay.reset(seed=seed)
        replies = [[]]
        for t, m in zip(tokens, mask):
            if m:
                replies[-1].append(t)
            elif replies[-1]:
                replies.append([])
        assert len(replies) == len(shortest_path(replay.maze))
        for reply in replies:
            assert reply[-1] == stop and stop not in reply[:-1]
            text = vlm_chat.decode(reply[:-1])
            move = parse_move(text)
            assert move == shortest_path(replay.maze, replay.pos)[0]
            if read:
                digits, space, word = text.partition(" ")
                assert space and word == move and len(digits) == 4
                lines = dict(line.split(": ") for line in replay.hint_lines().splitlines())
                for digit, name in zip(digits, MOVES):
                    assert (digit != "0") == (name in lines["open"].split())
                    assert (digit == "2") == (name in lines["new"].split())
                seen.update(digits)
            else:
                assert text == move
            _, reward, terminated, _, _ = replay.step(text)
        assert terminated and reward == 1.0
    assert seen == ({"0", "1", "2"} if read else set())


def test_exact_replies_count_a_reply_only_when_every_token_is_the_models_first_choice(tiny_vlm, vlm_chat):
    """Train the untrained tiny VLM on one exercise until it writes it: its score on that exercise
    goes from 0 to 1, and stays 0 on exercises it has not learned."""
    from policy.load import load_model

    torch.manual_seed(0)
    model = load_model(tiny_vlm)
    pad, scheme = vlm_chat.tokenizer.pad_token_id, vlm_chat.scheme
    env = ImageMazeEnv()
    one = [description(env, vlm_chat, 1)]
    assert exact_replies(model, one, pad, scheme) == 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        _train_step(model, opt, one, pad, scheme)
        model.eval()
        if exact_replies(model, one, pad, scheme) == 1.0:
            break
    assert exact_replies(model, one, pad, scheme) == 1.0
    others = [description(env, vlm_chat, seed) for seed in range(100, 108)]
    others = [o for o in others if o[0][-12:] != one[0][0][-12:]]  # a different reply
    assert exact_replies(model, others, pad, scheme) < 1.0


@pytest.mark.parametrize("target, budget, last", [(0.0, 60, 50), (1.1, 3, 3)])
def test_the_perception_stage_stops_at_its_target_or_its_step_budget(tiny_vlm, vlm_chat, target, budget, last):
    """Each part (single pictures, then pictures inside episodes) is scored every 50 steps and at
    its last: a target already met stops it at step 50, one that cannot be met runs it to its budget."""
    from policy.load import load_model

    model = load_model(tiny_vlm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = WarmstartConfig(batch=2, perception_max_steps=budget, episode_perception_max_steps=budget,
                          perception_val_size=4, perception_target=target)
    lines: list[str] = []
    score = perceive(model, opt, ImageMazeEnv(), vlm_chat, cfg, first_seed=0, log=lines.append)
    assert 0.0 <= score <= 1.0
    assert len(lines) == 2
    assert f"perception (single pictures) step {last} " in lines[0]
    assert f"perception (in episodes) step {last} " in lines[1]


def test_a_qwen_vl_warm_start_scores_its_rows_at_their_multimodal_positions(qwen_vl, qwen_vl_chat):
    """Demonstrations for a Qwen-VL model carry each row's M-RoPE positions into the loss (Qwen2.5-VL
    would otherwise fall back to 1-D positions without a word)."""
    from launch.warmstart import _collate, demonstration, sft_loss
    from policy.load import load_model

    env, scheme = ImageMazeEnv(max_steps=3), qwen_vl_chat.scheme
    examples = [demonstration(env, qwen_vl_chat, seed, noise=0.0) for seed in (1, 2)]
    ids, mask, inputs = _collate(examples, qwen_vl_chat.tokenizer.pad_token_id, scheme)
    for row, (tokens, _, images) in enumerate(examples):
        want = scheme.positions(tokens, images)
        assert torch.equal(inputs["position_ids"][:, row, : len(tokens)], want)
        assert not torch.equal(want[0], torch.arange(len(tokens)))  # the pictures' rows and columns
    model = load_model(qwen_vl)
    assert torch.isfinite(sft_loss(model, ids, mask, inputs))


def test_the_warm_start_checks_its_band_at_the_actors_token_budget():
    # A reply with a stray prefix is a move at the actors' budget and is cut before its direction at a
    # smaller one, so a check at another budget lands the run's version 0 outside the band.
    from actors.actor import ActorConfig

    assert WarmstartConfig().max_new_tokens == ActorConfig().max_new_tokens
