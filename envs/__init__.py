"""Text environments on the Gymnasium API, registered under `tandem/`.

`--env` takes a short name below (`dataset`: rows of a file and a reward function),
`skyrl:<id>` for a skyrl-gym environment, or
`module:Class` for any `TextEnv` of your own (see the README, "Write your own
environment").
"""

import importlib

import gymnasium as gym

from envs.base import Messages, TextEnv

ENVS = {
    "maze": "envs.maze:MazeEnv",
    "image-maze": "envs.image_maze:ImageMazeEnv",
    "countdown": "envs.countdown:CountdownEnv",
    "sql": "envs.sql:SqlEnv",
    "calculator": "envs.calculator:CalculatorEnv",
    "code": "envs.code:CodeEnv",
    "skyrl": "envs.skyrl:SkyrlEnv",
    "dataset": "envs.dataset:DatasetEnv",
}
"""Short names accepted by `--env`, mapped to entry points (skyrl is used as skyrl:<id>)."""

for _name, _entry in ENVS.items():
    if f"tandem/{_name}-v0" not in gym.registry:
        gym.register(id=f"tandem/{_name}-v0", entry_point=_entry, disable_env_checker=True)


def env_entry(name: str) -> str:
    """The Gymnasium id for `--env name`, registering `module:Class` names on first use;
    ValueError with the choices when there is none."""
    if name in ENVS and name != "skyrl":
        return f"tandem/{name}-v0"
    if name.startswith("skyrl:") and len(name) > len("skyrl:"):
        return "tandem/skyrl-v0"
    if ":" in name and not name.startswith("skyrl"):
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--env {name!r}: cannot import {attr} from {module} ({exc})") from None
        if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
            raise ValueError(f"--env {name!r} is not a TextEnv subclass")
        env_id = f"tandem/{module}.{attr}-v0"
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=name, disable_env_checker=True)
        return env_id
    if name in gym.registry:
        return name
    choices = [n for n in ENVS if n != "skyrl"] + ["skyrl:<id>", "module:Class"]
    raise ValueError(f"unknown environment {name!r}; choose one of {', '.join(choices)}")


def make_env(name: str, **kwargs) -> TextEnv:
    """Build environment `name` (see `env_entry` for the names it takes)."""
    env_id = env_entry(name)
    if env_id == "tandem/skyrl-v0":
        kwargs = {**kwargs, "name": name.split(":", 1)[1]}
    return gym.make(env_id, **kwargs).unwrapped


__all__ = ["ENVS", "Messages", "TextEnv", "env_entry", "make_env"]
