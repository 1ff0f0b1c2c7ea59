"""Text environments on the Gymnasium API, registered under `tandem/`."""

import gymnasium as gym

from envs.base import Messages, TextEnv

ENVS = {"maze": "envs.maze:MazeEnv"}
"""Short names accepted by `--env`, mapped to entry points."""

for _name, _entry in ENVS.items():
    if f"tandem/{_name}-v0" not in gym.registry:
        gym.register(id=f"tandem/{_name}-v0", entry_point=_entry, disable_env_checker=True)


def make_env(name: str, **kwargs) -> TextEnv:
    """Build environment `name` (a short name such as "maze", or a full gym id)."""
    env_id = f"tandem/{name}-v0" if name in ENVS else name
    if env_id not in gym.registry:
        raise ValueError(f"unknown environment {name!r}; choose one of {sorted(ENVS)}")
    return gym.make(env_id, **kwargs).unwrapped


__all__ = ["ENVS", "Messages", "TextEnv", "make_env"]
