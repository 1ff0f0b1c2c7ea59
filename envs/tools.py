"""Tools an environment declares, and the structured calls it is handed in tool-call mode.

In tool-call mode an environment declares its tools (`TextEnv.tools`) as JSON schemas in the
OpenAI function format; the chat template renders them into the prompt, the actor parses the
model's calls in its family's format (policy/tools.py) and hands the environment a `ToolTurn`:
the turn's text outside the calls, and the calls in order. `TextEnv.run_tools` answers each
call with a `tool` message: the tool's result, or what was wrong with the call.

Design decisions:
- **A call that cannot be used is an observation, never an exception**: bad JSON (the parser
  says so in `ToolCall.error`), a tool the environment does not declare, arguments that do not
  fit the schema. The model reads what was wrong and may try again.
- **Schemas are a small subset of JSON Schema, checked here** (no dependency): an object of named
  properties of type string, integer, number, boolean, array or object, with `description`,
  `enum` and `required`. A `Tool` with anything else is refused when it is declared, so a
  schema the validator would not enforce never reaches a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_CALLS = 8
"""Tool calls answered per turn; the rest get one message saying so."""

_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                       "boolean": (bool,), "array": (list,), "object": (dict,)}
_PROPERTY_KEYS = {"type", "description", "enum"}
_SCHEMA_KEYS = {"type", "properties", "required", "additionalProperties"}


@dataclass(frozen=True)
class Tool:
    """A tool: its name, what it does (the model reads it) and its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not self.name.replace("_", "").isalnum() or not self.name.isascii():
            raise ValueError(f"tool name {self.name!r}: letters, digits and underscores only")
        p = self.parameters
        where = f"tool {self.name!r}: parameters"
        if not isinstance(p, dict) or p.get("type") != "object" or not isinstance(p.get("properties"), dict):
            raise ValueError(f"{where} must be a JSON schema {{'type': 'object', 'properties': {{...}}}}, got {p!r}")
        if set(p) - _SCHEMA_KEYS:
            raise ValueError(f"{where}: unsupported keys {sorted(set(p) - _SCHEMA_KEYS)} (supported: "
                             f"{sorted(_SCHEMA_KEYS)})")
        if p.get("additionalProperties", False) is not False:
            raise ValueError(f"{where}: additionalProperties must be false (extra arguments are refused)")
        for name, prop in p["properties"].items():
            if not isinstance(prop, dict) or prop.get("type") not in _TYPES or set(prop) - _PROPERTY_KEYS:
                raise ValueError(f"{where}: property {name!r} must be {{'type': one of {sorted(_TYPES)}}} with "
                                 f"optional 'description' and 'enum', got {prop!r}")
        missing = [r for r in p.get("required", []) if r not in p["properties"]]
        if missing:
            raise ValueError(f"{where}: required {missing} are not among its properties")

    def schema(self) -> dict[str, Any]:
        """The OpenAI function format that chat templates render (`apply_chat_template(tools=...)`)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check(self, arguments: Any) -> str | None:
        """What is wrong with `arguments` for this tool, or None when they fit its schema."""
        if not isinstance(arguments, dict):
            return f"the arguments of {self.name} must be a JSON object, got {type(arguments).__name__}"
        props = self.parameters["properties"]
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return f"{self.name} has no argument {unknown[0]!r} (its arguments: {', '.join(props) or 'none'})"
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"{self.name} needs the argument {missing[0]!r}"
        for k, v in arguments.items():
            kind = props[k]["type"]
            if not isinstance(v, _TYPES[kind]) or (isinstance(v, bool) and kind != "boolean"):
                return f"the argument {k!r} of {self.name} must be a{'n' * (kind[0] in 'aeiou')} {kind}, got {v!r:.80}"
            if "enum" in props[k] and v not in props[k]["enum"]:
                return f"the argument {k!r} of {self.name} must be one of {props[k]['enum']}, got {v!r:.80}"
        return None


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments, or (`error`) why the text of
    the call could not be read as one (bad JSON, no name)."""

    name: str
    arguments: dict[str, Any]
    error: str = ""


@dataclass(frozen=True)
class ToolTurn:
    """A model turn in tool-call mode: its text outside the calls, and the calls in order."""

    text: str
    calls: tuple[ToolCall, ...] = ()


class ToolError(Exception):
    """A tool that could not do what it was asked (its message goes back to the model)."""
