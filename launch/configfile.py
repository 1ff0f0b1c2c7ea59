"""`--config FILE`: a run's settings in a YAML or JSON file, in the same shape as the flags.

Top-level keys are the headline flags (`steps`, `max_staleness` or `max-staleness`), nested
mappings are the sections (`learner: {lr: 1e-4, lora: {rank: 16}}`); whatever the file leaves
out keeps its default, and flags given on the command line override the file. A run directory's
`config.json` is such a file too: it starts a new run with the same settings, in a run directory
of its own. A key that is not a flag fails naming it (and the closest flag); values are checked
as the flags' are (`__post_init__`). Parsing the file's values goes through each field's type,
so YAML's `1e-4` (a string to YAML 1.1) is the float it means, and a mapping given for a
JSON-valued flag (`chat_template_kwargs: {enable_thinking: false}`) is that JSON.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing

SKIPPED = ("config",)
"""Keys a file may carry and that are not settings: the file a run was started from."""


def read_config_file(path: str) -> dict:
    """The file's mapping; ValueError saying what is wrong with it."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    import yaml

    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if path.endswith(".json") else "YAML"
        raise ValueError(f"--config {path}: not valid {kind}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must hold a mapping of flags to values, got {type(data).__name__}")
    return data


def config_from_file(cls, path: str, under: dict | None = None):
    """An instance of the root config `cls` with the file's settings over `under` (nested
    sections: the environment's own defaults) over the defaults. Its `model` stays as the file
    gives it ("auto" when absent), so that an `--env` given on the command line still picks its
    own default model."""
    data = _over(read_config_file(path), under or {})
    fields = _fields(cls, data, path, "")
    if "resume" in fields and fields["resume"]:
        raise ValueError(f"--config {path}: 'resume' has no place in a config file; run --resume DIR instead")
    if _is_run_config(path, fields.get("logdir")):
        fields["logdir"] = None  # a run's own config.json: the new run gets a directory of its own
    fields.pop("resume", None)
    cfg = cls(**fields)
    if "model" not in fields:
        cfg.model = "auto"
    return cfg


def _over(data: dict, under: dict) -> dict:
    """The file's mapping with `under`'s values where it gives none (keys with - or _ alike)."""
    out = dict(data)
    for key, value in under.items():
        given = next((k for k in data if str(k).replace("-", "_") == key), None)
        if given is None:
            out[key] = value
        elif isinstance(value, dict) and isinstance(data[given], dict):
            out[given] = _over(data[given], value)
    return out


def _is_run_config(path: str, logdir) -> bool:
    if not logdir or not os.path.isdir(logdir):
        return False
    return os.path.samefile(os.path.dirname(os.path.abspath(path)), logdir)


def _fields(cls, data: dict, path: str, prefix: str) -> dict:
    """Constructor arguments of the dataclass `cls` from the file's mapping `data`."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if not prefix and name in SKIPPED:
            continue
        if name not in names:
            flags = [prefix + n.replace("_", "-") for n in names]
            close = difflib.get_close_matches(prefix + name.replace("_", "-"), flags, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"--config {path}: unknown key {prefix}{key}{hint}; every key is a flag of "
                             "`python -m launch.async --help` without its dashes, sections as nested mappings")
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ValueError(f"--config {path}: {prefix}{key} is a section: give it a mapping of its flags")
            out[name] = kind(**_fields(kind, value, path, f"{prefix}{name}."))
        else:
            out[name] = _coerce(kind, value, f"{prefix}{key}", path)
    return out


def _coerce(kind, value, key: str, path: str):
    """`value` as the field type `kind` wants it; ValueError naming the key otherwise."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kind = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    bad = ValueError(f"--config {path}: {key} must be {_describe(kind)}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"--config {path}: {key} must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_coerce(args[0], v, key, path) for v in value]
    if kind is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if kind in (int, float):
        if isinstance(value, bool):
            raise bad
        if isinstance(value, str):
            try:
                value = float(value) if kind is float else int(value)
            except ValueError:
                raise bad from None
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise bad
        return kind(value)
    if kind is str:
        if isinstance(value, dict):  # --chat-template-kwargs, --skyrl.env-config: JSON objects
            return json.dumps(value)
        if isinstance(value, list) or value is None:
            raise bad
        return str(value)
    return value


def _describe(kind) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))
