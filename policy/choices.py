"""The one check of the config's choice fields.

A choice field is typed `Literal[...]` (`--algo`, `--learner.aggregation`, `--actor.engine`, ...):
tyro lists its choices in `--help` and refuses any other value on the command line. A section
made in code (a test, a benchmark, a service building a learner) or read back from a run's
config.json is not parsed by tyro; each section's `__post_init__` calls `check_choices`, which
holds the value against the same `Literal`, so there is one list of choices and one check. It
lives in policy/ beside `LoraSpec` because every part with a config section can import it.
"""

from __future__ import annotations

import dataclasses
import typing


def check_choice(flag: str, value, choices: tuple) -> None:
    """ValueError naming `flag` and its `choices` unless `value` is one of them."""
    if value not in choices:
        raise ValueError(f"unknown {flag} {value!r}; choose one of {', '.join(map(str, choices))}")


def check_choices(section, prefix: str = "--") -> None:
    """Every choice field (a `Literal` type) of the dataclass `section`, and of the sections nested
    in it, holds one of its choices; ValueError naming the flag (`prefix` + the field) otherwise."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value, flag = getattr(section, f.name), prefix + f.name.replace("_", "-")
        if typing.get_origin(hints[f.name]) is typing.Literal:
            check_choice(flag, value, typing.get_args(hints[f.name]))
        if dataclasses.is_dataclass(value):
            check_choices(value, flag + ".")
