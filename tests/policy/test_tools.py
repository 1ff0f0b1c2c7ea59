"""Tool calls in the model's own format: declared tools → the model's call → the parsed call → the
tool message → the next turn, token for token what the family's template renders.

Tokenizers carry the published templates of Qwen2.5, Qwen3 and Llama 3.1 (tests/policy/templates.py).
"""

import json

import numpy as np

import pytest

from envs.calculator import CalculatorEnv, Problem
from envs.sql import SqlEnv, make_question
from envs.tools import ToolCall, ToolTurn
from policy.chat import Chat
from policy.tools import FORMATS, Call, detect_format, parse_hermes, parse_llama3_json
from tests.policy.templates import LLAMA31, QWEN3, QWEN25, build_tokenizer

FAMILIES = ("qwen2.5", "qwen3", "llama3")
THINK = "<think>\nI need the tool.\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizers():
    return {family: build_tokenizer(family) for family in FAMILIES}


def model_call(family: str, name: str, arguments: dict) -> str:
    """What a model of `family` writes to call a tool (Qwen3 thinks first)."""
    if family == "llama3":
        return json.dumps({"name": name, "parameters": arguments})
    return (THINK if family == "qwen3" else "") + f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def assistant_call(family: str, name: str, arguments: dict) -> dict:
    """The same turn as a structured chat message (the OpenAI format templates render)."""
    return {"role": "assistant", "content": THINK if family == "qwen3" else "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def calculator():
    env = CalculatorEnv(tool_calls=True)
    opening, _ = env.reset(options={"problem": Problem("12 crates hold 7 jars each and 5 jars are loose. "
                                                       "How many jars?", 89)})
    return env, opening, [("calculate", {"expression": "12 * 7"}, "84"),
                          ("calculate", {"expression": "84 + 5"}, "89")]


def sql():
    env = SqlEnv(tool_calls=True)
    opening, _ = env.reset(options={"question": make_question(np.random.default_rng(3))})
    query = "SELECT name, city FROM departments ORDER BY id LIMIT 3"
    return env, opening, [("run_query", {"sql": query}, "name | city\nSales |"),
                          ("run_query", {"sql": "SELECT COUNT(*) FROM projects"}, "COUNT(*)\n20\n(1 row)")]


@pytest.mark.parametrize("make_env", [calculator, sql])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_calling_episode_is_the_templates_rendering_token_for_token(tokenizers, family, make_env):
    tok = tokenizers[family]
    env, opening, calls = make_env()
    chat = Chat(tok, tools=[t.schema() for t in env.tools])
    tokens, messages = chat.prompt_ids(opening), list(opening)
    assert env.tools[0].name in tok.decode(tokens)  # the prompt declares the tool
    for name, arguments, result in calls:
        model = tok.encode(model_call(family, name, arguments), add_special_tokens=False) + [chat.end_of_turn]
        text, parsed = chat.parse_tools(chat.decode(model))
        assert parsed == [Call(name, arguments)]
        assert text == (THINK.strip() if family == "qwen3" else "")
        obs, reward, terminated, truncated, _ = env.step(ToolTurn(text, (ToolCall(name, arguments),)))
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert len(obs) == 1 and obs[0]["role"] == "tool" and obs[0]["content"].startswith(result)
        tokens = tokens + model + chat.observation_ids(obs)
        messages += [assistant_call(family, name, arguments), *obs]
    text = tok.apply_chat_template(messages, tools=chat.tools, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(messages, tools=chat.tools, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    assert tok.decode(tokens) == text
    assert tokens == list(ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_answer_after_tool_calls_ends_the_episode(tokenizers, family):
    env, opening, _ = calculator()
    chat = Chat(tokenizers[family], tools=[t.schema() for t in env.tools])
    text, calls = chat.parse_tools("The total is 89.\nanswer: 89")
    assert calls == []
    _, reward, terminated, _, _ = env.step(ToolTurn(text))
    assert reward == 1.0 and terminated


@pytest.mark.parametrize("template, expected", [(QWEN25, "hermes"), (QWEN3, "hermes"), (LLAMA31, "llama3-json"),
                                                ("{% for m in messages %}{{ m.content }}{% endfor %}", None)])
def test_the_tool_call_format_is_read_off_the_template(template, expected):
    assert detect_format(template) == expected


@pytest.mark.parametrize("text, error", [
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": 12 * 7}}\n</tool_call>', "not valid JSON"),
    ('<tool_call>\n{"arguments": {"expression": "1"}}\n</tool_call>', 'needs a "name"'),
    ('<tool_call>\n["calculate"]\n</tool_call>', 'needs a "name"'),
    ('<tool_call>\n{"name": "calculate", "arguments": [1, 2]}\n</tool_call>', "must be a JSON object"),
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 +', "not closed with </tool_call>"),
])
def test_a_hermes_call_that_cannot_be_read_is_returned_with_its_error(text, error):
    rest, calls = parse_hermes("Let me compute.\n" + text)
    assert rest == "Let me compute."
    assert len(calls) == 1 and error in calls[0].error and "<tool_call>" in calls[0].error  # shows the format


def test_hermes_reads_every_call_of_a_turn_in_order_and_arguments_given_as_a_string():
    text = ('First.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\nThen.\n'
            '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": \\"z\\"}"}\n</tool_call>')
    assert parse_hermes(text) == ("First.\n\nThen.", [Call("a", {"x": 1}), Call("b", {"y": "z"})])


@pytest.mark.parametrize("text, expected", [
    ('{"name": "calculate", "parameters": {"expression": "2"}}', ("", [Call("calculate", {"expression": "2"})])),
    ('{"name": "calculate", "arguments": {"expression": "2"}}', ("", [Call("calculate", {"expression": "2"})])),
    ("answer: 89", ("answer: 89", [])),
])
def test_llama3_json_reads_a_turn_that_is_one_json_object(text, expected):
    assert parse_llama3_json(text) == expected


def test_a_llama3_turn_of_broken_json_is_a_call_with_its_error():
    _, calls = parse_llama3_json('{"name": "calculate", "parameters": {"expression": "2"}')
    assert len(calls) == 1 and "not valid JSON" in calls[0].error and '"parameters"' in calls[0].error


def test_a_template_that_ignores_tools_fails_at_construction(chat):
    tools = [t.schema() for t in CalculatorEnv(tool_calls=True).tools]
    with pytest.raises(ValueError, match="ignores tools.*without tool calls"):
        Chat(chat.tokenizer, tools=tools)


def test_a_template_of_an_unknown_format_must_be_named_and_a_named_format_must_exist(tokenizers):
    tools = [t.schema() for t in CalculatorEnv(tool_calls=True).tools]
    tok = build_tokenizer("qwen2.5")
    tok.chat_template = QWEN25.replace("<tool_call>", "<call>").replace("</tool_call>", "</call>")
    with pytest.raises(ValueError, match="not one Tandem recognises: name it with --tool-format"):
        Chat(tok, tools=tools)
    assert Chat(tok, tools=tools, tool_format="hermes").tool_format == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'; choose one of auto, hermes, llama3-json"):
        Chat(tokenizers["qwen2.5"], tools=tools, tool_format="xml")
    assert set(FORMATS) == {"hermes", "llama3-json"}
