"""Tool-call mode: declared tools, calls checked against their schemas, and every malformed call
answered with a tool message that says what was wrong, never an exception."""

import re

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from envs import make_env
from envs.calculator import CalculatorEnv, Problem
from envs.sql import SqlEnv, make_question
from envs.tools import MAX_CALLS, Tool, ToolCall, ToolTurn

ADD = Tool("add", "Add two integers.", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}, "mode": {"type": "string", "enum": ["exact", "fast"]}},
    "required": ["a", "b"]})


@pytest.mark.parametrize("name, parameters, error", [
    ("add two", {"type": "object", "properties": {}}, "letters, digits and underscores"),
    ("add", {"type": "array"}, "must be a JSON schema"),
    ("add", {"type": "object", "properties": {}, "oneOf": []}, r"unsupported keys \['oneOf'\]"),
    ("add", {"type": "object", "properties": {}, "additionalProperties": True}, "additionalProperties must be false"),
    ("add", {"type": "object", "properties": {"a": {"type": "int"}}}, "property 'a' must be"),
    ("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, "property 'a' must be"),
    ("add", {"type": "object", "properties": {}, "required": ["a"]}, r"required \['a'\] are not among"),
])
def test_a_schema_the_validator_would_not_enforce_is_refused_when_declared(name, parameters, error):
    with pytest.raises(ValueError, match=error):
        Tool(name, "Add.", parameters)


@pytest.mark.parametrize("arguments, error", [
    ({"a": 1, "b": 2}, None),
    ({"a": 1, "b": 2, "mode": "exact"}, None),
    ([1, 2], "must be a JSON object, got list"),
    ({"a": 1, "b": 2, "c": 3}, "add has no argument 'c' \\(its arguments: a, b, mode\\)"),
    ({"a": 1}, "add needs the argument 'b'"),
    ({"a": 1, "b": "2"}, "the argument 'b' of add must be an integer, got '2'"),
    ({"a": 1, "b": 2.5}, "the argument 'b' of add must be an integer"),
    ({"a": True, "b": 2}, "the argument 'a' of add must be an integer, got True"),
    ({"a": 1, "b": 2, "mode": "slow"}, "must be one of \\['exact', 'fast'\\]"),
])
def test_arguments_are_checked_against_the_schema(arguments, error):
    found = ADD.check(arguments)
    assert found is None if error is None else re.search(error, found), found


def test_the_schema_is_the_openai_function_format():
    assert ADD.schema() == {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                                             "parameters": ADD.parameters}}


def calc_env():
    env = CalculatorEnv(tool_calls=True, max_turns=3)
    env.reset(options={"problem": Problem("What is 12 * 7?", 84)})
    return env


def call(name, **arguments):
    return ToolCall(name, arguments)


@pytest.mark.parametrize("bad, says", [
    (ToolCall("", {}, "the tool call is not valid JSON (Expecting value at character 40); write <tool_call>..."),
     "error: the tool call is not valid JSON"),
    (call("search", query="12 * 7"), "error: there is no tool 'search'; the tools are calculate"),
    (call("calculate", expr="12 * 7"), "error: calculate has no argument 'expr'"),
    (call("calculate"), "error: calculate needs the argument 'expression'"),
    (call("calculate", expression=84), "error: the argument 'expression' of calculate must be a string, got 84"),
    (call("calculate", expression="__import__('os')"), "error: function calls are not allowed"),
])
def test_a_malformed_call_gets_a_tool_message_saying_what_was_wrong(bad, says):
    env = calc_env()
    obs, reward, terminated, truncated, info = env.step(ToolTurn("", (bad, call("calculate", expression="12 * 7"))))
    assert [m["role"] for m in obs] == ["tool", "tool"]
    assert obs[0]["content"].startswith(says)
    assert obs[1]["content"] == "84"  # the good call of the same turn still runs
    assert (reward, terminated, truncated) == (0.0, False, False)


def test_a_turn_without_calls_or_an_answer_gets_a_reminder_and_the_turn_limit_holds():
    env = calc_env()
    obs, _, terminated, truncated, _ = env.step(ToolTurn("I think it is big."))
    assert obs == ({"role": "user", "content": "No tool call or answer found. " + env.TOOL_INSTRUCTIONS},)
    assert not terminated and not truncated
    env.step(ToolTurn("", (call("calculate", expression="1"),)))
    _, _, terminated, truncated, info = env.step(ToolTurn("", (call("calculate", expression="2"),)))
    assert truncated and not terminated and info["calls"] == 2


def test_calls_past_the_limit_of_a_turn_are_not_run_and_say_so():
    env = calc_env()
    obs, *_, info = env.step(ToolTurn("", tuple(call("calculate", expression=str(i)) for i in range(MAX_CALLS + 3))))
    assert [m["content"] for m in obs[:MAX_CALLS]] == [str(i) for i in range(MAX_CALLS)]
    assert obs[-1]["content"] == f"error: at most {MAX_CALLS} tool calls a turn; 3 more were not run"
    assert info["calls"] == MAX_CALLS


def test_a_text_action_is_a_turn_without_calls_and_a_tool_turn_needs_tools():
    env = calc_env()
    _, reward, terminated, _, _ = env.step("answer: 84")
    assert reward == 1.0 and terminated
    plain = CalculatorEnv()
    plain.reset(seed=0)
    with pytest.raises(TypeError, match="declares no tools: step it with the model's text"):
        plain.step(ToolTurn("answer: 1"))
    with pytest.raises(TypeError, match="or a ToolTurn in tool-call mode, got int"):
        plain.step(3)


def test_text_mode_is_unchanged():
    env = CalculatorEnv()
    obs, _ = env.reset(options={"problem": Problem("What is 12 * 7?", 84)})
    assert env.tools == () and "`calc: <expression>`" in obs[0]["content"]
    assert env.step("calc: 12 * 7")[0][0] == {"role": "user", "content": "calc: 12 * 7 = 84"}


def test_sql_in_tool_call_mode_answers_queries_with_rows_or_the_error_and_grades_the_answer():
    env = SqlEnv(tool_calls=True)
    question = make_question(np.random.default_rng(0))
    obs, _ = env.reset(options={"question": question})
    assert "Call the run_query tool" in obs[0]["content"]
    obs, *_ = env.step(ToolTurn("", (call("run_query", sql="SELECT COUNT(*) FROM departments;"),
                                     call("run_query", sql="DELETE FROM employees"))))
    assert obs[0] == {"role": "tool", "content": "COUNT(*)\n8\n(1 row)"}
    assert obs[1]["content"].startswith("error: not authorized: the database is read-only")
    _, reward, terminated, _, _ = env.step(ToolTurn(f"answer: {question.gold}"))
    assert reward == 1.0 and terminated
    env.close()


@pytest.mark.parametrize("name", ["calculator", "sql"])
def test_gymnasium_env_checker_passes_in_tool_call_mode(name):
    env = make_env(name, tool_calls=True)
    assert env.tools
    check_env(env, skip_render_check=True)
    env.close()
