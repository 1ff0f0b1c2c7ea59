"""Tool calls in the model's own format: one parser a chat-template family.

Instruct models write tool calls the way their chat template renders them; the parser of the
family reads them back out of a model turn's text (decoded with the special tokens dropped).
The registry `FORMATS` maps a format's name to its parser; `detect_format` picks it from the
template's text (`--tool-format auto`), or the run names it.

- **hermes**: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a
  call, as many as the model likes (Qwen2.5, Qwen3, QwQ, Hermes). The text outside the blocks
  is the turn's text.
- **llama3-json**: the whole turn is one JSON object `{"name": ..., "parameters": {...}}`
  (Llama 3.1, 3.2 and 3.3 with custom tools; "arguments" is read too). A turn that does not
  start with `{` is text.

A call that cannot be read (bad JSON, no name, arguments that are not an object, a block cut
off by the token limit) is returned with `error` set, saying what is wrong and the format
expected: the environment answers it with that message, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple


class Call(NamedTuple):
    """One call read from a model turn: name and arguments, or why it could not be read."""

    name: str
    arguments: dict[str, Any]
    error: str = ""


_HERMES_SHAPE = '<tool_call>\n{"name": <tool name>, "arguments": {<argument>: <value>, ...}}\n</tool_call>'
_LLAMA_SHAPE = '{"name": <tool name>, "parameters": {<argument>: <value>, ...}}'
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _call(body: str, arguments_key: str, shape: str) -> Call:
    """The call a JSON object's text `body` describes, or one with `error` set."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return Call("", {}, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}); write {shape}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return Call("", {}, f"the tool call needs a \"name\" (a string); write {shape}")
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return Call(obj["name"], {}, f"the arguments of {obj['name']!r:.60} must be a JSON object; write {shape}")
    return Call(obj["name"], arguments)


def parse_hermes(text: str) -> tuple[str, list[Call]]:
    """(the text outside the `<tool_call>` blocks, the calls in order)."""
    calls = []
    for block in _HERMES_BLOCK.finditer(text):
        if not block.group(0).endswith("</tool_call>"):
            calls.append(Call("", {}, f"the tool call is not closed with </tool_call>; write {_HERMES_SHAPE}"))
        else:
            calls.append(_call(block.group(1).strip(), "arguments", _HERMES_SHAPE))
    return _HERMES_BLOCK.sub("", text).strip(), calls


def parse_llama3_json(text: str) -> tuple[str, list[Call]]:
    """("", [the call]) when the turn is a JSON object, else (the text, [])."""
    body = text.strip()
    if not body.startswith("{"):
        return text.strip(), []
    return "", [_call(body, "parameters", _LLAMA_SHAPE)]


FORMATS: dict[str, Callable[[str], tuple[str, list[Call]]]] = {
    "hermes": parse_hermes,
    "llama3-json": parse_llama3_json,
}
"""Tool-call formats by name (`--tool-format`): the parser of a model turn's text."""


def detect_format(template: str) -> str | None:
    """The tool-call format a chat template renders its assistant's calls in, or None."""
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": ' in template and "ipython" in template:
        return "llama3-json"
    return None
