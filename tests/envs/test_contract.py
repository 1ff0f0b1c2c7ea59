"""The environment contract, checked on every built-in environment as a user's trainer would
use it: Gymnasium's own checker, seeded determinism, held-out evaluation sets, hostile actions."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from envs import ENVS, make_env
from envs.base import MAX_IMAGE_SIDE, MAX_IMAGES, ContentSpace, TextEnv, content_images, content_text, messages

BUILT_IN = [name for name in ENVS if name not in ("skyrl", "dataset")]  # those two need a file: their own tests
TEXT_ONLY = [name for name in BUILT_IN if name != "image-maze"]


def key(obs) -> tuple:
    """An observation as a hashable value: texts, and images by shape and bytes."""
    def part(p):
        return (p["type"], p["text"]) if p["type"] == "text" else (p["type"], p["image"].shape, p["image"].tobytes())
    return tuple((m["role"], m["content"] if isinstance(m["content"], str) else tuple(map(part, m["content"])))
                 for m in obs)

HOSTILE = [
    "",                                        # empty
    "   \n\n\t  ",                             # whitespace only
    "x" * 200_000,                             # enormous
    "\x00\x01\x1b[31m\x7f\ufffd\ud7ff",        # control characters and odd code points
    "ÿþ🙂 ︎\u202eright\u202c ùp",             # garbled Unicode around a valid word
    "answer: query: calc: ``` ``` #### ::: ",  # every command prefix, none complete
    "up " * 3000,                              # long and repetitive
]


def test_at_least_four_environments_are_registered_under_tandem():
    ids = [i for i in gym.registry if i.startswith("tandem/")]
    assert len(BUILT_IN) >= 4
    for name in BUILT_IN:
        assert f"tandem/{name}-v0" in ids


@pytest.mark.parametrize("name", BUILT_IN)
def test_gymnasium_env_checker_passes(name):
    env = make_env(name)
    check_env(env, skip_render_check=True)
    env.close()


@pytest.mark.parametrize("name", BUILT_IN)
def test_reset_with_a_seed_is_deterministic_and_seeds_differ(name):
    first = [key(make_env(name).reset(seed=s)[0]) for s in range(6)]
    again = [key(make_env(name).reset(seed=s)[0]) for s in range(6)]
    assert first == again
    assert len(set(first)) > 1


@pytest.mark.parametrize("name", BUILT_IN)
def test_hostile_actions_get_an_observation_never_an_exception(name):
    env = make_env(name)
    for action in HOSTILE:
        env.reset(seed=1)
        obs, reward, terminated, truncated, info = env.step(action)
        assert obs in env.observation_space, repr(action[:40])
        assert obs and obs[0]["content"], "the observation says what happened"
        assert isinstance(reward, float) and reward == 0.0
    env.close()


@pytest.mark.parametrize("name", BUILT_IN)
def test_evaluation_set_is_fixed_distinct_and_never_drawn_in_training(name):
    env = make_env(name)
    tasks = env.eval_tasks(env.eval_seed, 64)
    assert len(tasks) == 64
    prompts = set()
    for task in tasks:
        prompts.add(key(env.reset(options=task)[0]))
    assert len(prompts) == 64
    assert env.eval_tasks(env.eval_seed, 64) == tasks
    for seed in range(300):
        assert key(env.reset(seed=seed)[0]) not in prompts
    env.close()


def test_observations_are_capped_and_cleaned():
    from envs.base import MAX_TEXT

    class Loud(TextEnv):
        def _reset(self, options):
            return "a\x00b\r\nc", {}

        def _step(self, text):
            return [{"role": "tool", "content": "z" * (MAX_TEXT * 3)}], 0.0, False, False, {}

    env = Loud()
    obs, _ = env.reset(seed=0)
    assert obs == ({"role": "user", "content": "ab\nc"},)
    obs, *_ = env.step("go")
    assert len(obs[0]["content"]) == MAX_TEXT and obs[0]["content"].endswith("[truncated]")
    assert obs in env.observation_space


@pytest.mark.parametrize("name", TEXT_ONLY)
def test_text_environments_still_observe_plain_strings(name):
    env = make_env(name)
    obs, _ = env.reset(seed=0)
    obs2, *_ = env.step("up")
    for m in obs + obs2:
        assert type(m["content"]) is str and type(m["role"]) is str
        assert content_text(m["content"]) == m["content"] and content_images(m["content"]) == []


def picture(h: int = 5, w: int = 7) -> np.ndarray:
    return np.arange(h * w * 3, dtype=np.uint8).reshape(h, w, 3)


class FakePIL:
    """What messages() sees when handed a PIL image: an object with mode and convert()."""
    mode = "RGB"

    def convert(self, mode):
        return self


def observe(*parts) -> tuple:
    return messages([{"role": "user", "content": list(parts)}])


def test_image_parts_round_trip_unchanged_and_read_only():
    image = np.asfortranarray(picture())  # not C-contiguous: normalised to a C-contiguous copy
    obs = observe({"type": "text", "text": "look\x00 here\r\n"}, {"type": "image", "image": image},
                  {"type": "image", "image": picture(1, 1)})
    content = obs[0]["content"]
    assert isinstance(content, tuple) and [p["type"] for p in content] == ["text", "image", "image"]
    assert content[0] == {"type": "text", "text": "look here\n"}
    out = content[1]["image"]
    assert np.array_equal(out, image) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert not out.flags.writeable and not np.shares_memory(out, image)
    with pytest.raises(ValueError):
        out[0, 0, 0] = 1
    image[0, 0, 0] = 99  # the environment's own array changing later does not reach the observation
    assert out[0, 0, 0] == 0
    assert content_text(content) == "look here\n"
    assert [i.shape for i in content_images(content)] == [(5, 7, 3), (1, 1, 3)]
    # Normalised content is in the space, and normalising again changes nothing.
    space = TextEnv().observation_space
    assert obs in space
    again = messages(list(obs))
    assert key(again) == key(obs)
    biggest = observe(*[{"type": "image", "image": np.zeros((MAX_IMAGE_SIDE, 1, 3), np.uint8)}] * MAX_IMAGES)
    assert biggest in space


def test_text_parts_together_are_capped():
    from envs.base import MAX_TEXT

    obs = observe(*[{"type": "text", "text": "z" * 3000}] * 3)
    texts = [p["text"] for p in obs[0]["content"]]
    assert sum(map(len, texts)) == MAX_TEXT
    assert obs in TextEnv().observation_space


BAD_IMAGES = {
    "float dtype": (picture().astype(np.float32) / 255, TypeError, r"dtype float32.*astype\(np.uint8\)"),
    "int64 dtype": (picture().astype(np.int64), TypeError, r"dtype int64"),
    "bool dtype": (np.ones((4, 4, 3), bool), TypeError, r"dtype bool"),
    "grey (H, W)": (picture()[..., 0], ValueError, r"shape \(5, 7\).*np.repeat"),
    "RGBA (H, W, 4)": (np.zeros((5, 7, 4), np.uint8), ValueError, r"shape \(5, 7, 4\).*x\[\.\.\., :3\]"),
    "channels first": (np.zeros((3, 5, 7), np.uint8), ValueError, r"shape \(3, 5, 7\).*transpose"),
    "4-D batch": (np.zeros((1, 5, 7, 3), np.uint8), ValueError, r"shape \(1, 5, 7, 3\)"),
    "empty": (np.zeros((0, 7, 3), np.uint8), ValueError, r"at least one pixel"),
    "too tall": (np.zeros((MAX_IMAGE_SIDE + 1, 2, 3), np.uint8), ValueError, r"MAX_IMAGE_SIDE = 1024.*downscale"),
    "too wide": (np.zeros((2, MAX_IMAGE_SIDE + 1, 3), np.uint8), ValueError, r"MAX_IMAGE_SIDE"),
    "PIL image": (FakePIL(), TypeError, r"got a PIL image.*np.asarray\(img.convert\('RGB'\)\)"),
    "nested list": (picture().tolist(), TypeError, r"got list.*np.asarray"),
    "bytes": (picture().tobytes(), TypeError, r"got bytes"),
    "None": (None, TypeError, r"got NoneType"),
}


@pytest.mark.parametrize("case", BAD_IMAGES)
def test_bad_images_are_refused_with_what_to_pass(case):
    image, error, match = BAD_IMAGES[case]
    with pytest.raises(error, match=match):
        observe({"type": "text", "text": "see"}, {"type": "image", "image": image})
    assert ({"type": "image", "image": image},) not in ContentSpace()


BAD_CONTENT = {
    "too many images": ([{"type": "image", "image": picture()}] * (MAX_IMAGES + 1), ValueError,
                        r"at most MAX_IMAGES = 8 images, part 8 is image 9"),
    "type not a string": ([{"type": np.zeros(2), "image": picture()}], ValueError, r"has type array"),
    "unknown part type": ([{"type": "image_url", "image_url": "http://x"}], ValueError, r"type 'image_url'"),
    "image without its key": ([{"type": "image", "url": "x.png"}], ValueError, r"keys 'type' and 'image'"),
    "text without its key": ([{"type": "text", "content": "hi"}], ValueError, r"keys 'type' and 'text'"),
    "part without a type": ([{"text": "hi"}], ValueError, r"type None"),
    "text not a string": ([{"type": "text", "text": 3}], TypeError, r"'text' must be a str"),
    "part not a dict": (["hi"], TypeError, r"part 0 must be a dict"),
    "content a number": (3, TypeError, r"str or a list of parts"),
    "content an array": (picture(), TypeError, r"str or a list of parts"),
}


@pytest.mark.parametrize("case", BAD_CONTENT)
def test_bad_content_is_refused_with_what_to_pass(case):
    content, error, match = BAD_CONTENT[case]
    with pytest.raises(error, match=match):
        messages([{"role": "user", "content": content}])
    if isinstance(content, list):
        assert tuple(content) not in ContentSpace()


def test_parts_passed_without_a_message_say_how_to_wrap_them():
    with pytest.raises(TypeError, match="wrap content parts in a message"):
        messages([{"type": "image", "image": picture()}])


def test_an_environment_returning_a_bad_image_raises_for_the_actor_to_record():
    class Bad(TextEnv):
        def _reset(self, options):
            return [{"role": "user", "content": [{"type": "image", "image": np.zeros((4, 4, 4), np.uint8)}]}], {}

    with pytest.raises(ValueError, match="shape"):
        Bad().reset(seed=0)


def test_content_space_samples_text_and_refuses_unnormalised_content():
    space = ContentSpace()
    space.seed(0)
    assert isinstance(space.sample(), str) and space.sample() in space
    assert "ab\x00" not in space and ["text"] not in space
    assert [{"type": "text", "text": "a"}] not in space                     # a list, not the tuple messages() makes
    assert ({"type": "text", "text": "a\x00"},) not in space               # text not cleaned
    assert ({"type": "text", "text": "a", "extra": 1},) not in space
