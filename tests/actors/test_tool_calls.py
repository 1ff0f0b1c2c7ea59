"""Environments in tool-call mode played by the real rollout (actors/rollout.py) and torch engine,
with a tiny decoder carrying a Qwen2.5 tokenizer and template (tests/policy/templates.py)."""

import pytest

from actors.engine import SamplingParams
from actors.envrunner import EnvRunner
from actors.rollout import evaluate, play, start
from actors.torch_engine import TorchEngine
from envs.calculator import CalculatorEnv, Problem
from envs.tools import ToolCall, ToolTurn
from policy.load import LoraSpec, load_chat
from tests.policy.templates import build_tokenizer

PROBLEM = Problem("12 crates hold 7 jars each. How many jars?", 84)
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 7"}}\n</tool_call>'


class Recording(CalculatorEnv):
    """The calculator in tool-call mode, keeping what each step was handed and answered."""

    def __init__(self):
        super().__init__(tool_calls=True, max_turns=3)
        self.steps = []

    def step(self, action):
        out = super().step(action)
        self.steps.append((action, out[0]))
        return out


def save(tmp_path, model, tok) -> str:
    path = tmp_path / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen_tok():
    return build_tokenizer("qwen2.5")


def tools():
    return [t.schema() for t in CalculatorEnv(tool_calls=True).tools]


def test_a_random_model_plays_tool_call_mode_and_every_turn_is_parsed_and_answered(tmp_path, qwen_tok):
    """Whatever a random model writes is parsed and answered (malformed calls included): no episode
    breaks, and each episode's tokens are the prompt, the sampled turns and the observations the
    environment returned for the parsed calls, as the template renders them."""
    from policy.tiny import build_model

    path = save(tmp_path, build_model(qwen_tok, hidden=32, layers=2, seed=1), qwen_tok)
    chat = load_chat(path, tools=tools())
    assert chat.tool_format == "hermes"
    engine, runner = TorchEngine(path, LoraSpec(rank=4), seed=3), EnvRunner(threads=2)
    envs = [Recording() for _ in range(4)]
    try:
        episodes = [start(env, chat, runner, options={"problem": PROBLEM}, sampling_seed=i) for i, env in enumerate(envs)]
        play(engine, chat, episodes, SamplingParams(12, chat.stop_ids, temperature=1.0), 2048, runner)
    finally:
        runner.close()
        engine.close()
    for ep, env in zip(episodes, envs):
        assert ep.finish_reason in ("terminated", "truncated"), ep.error
        opening = env.reset(options={"problem": PROBLEM})[0]
        expected, at = chat.prompt_ids(opening), len(chat.prompt_ids(opening))
        assert "<tools>" in qwen_tok.decode(expected) and '"name": "calculate"' in qwen_tok.decode(expected)
        assert len(env.steps) == ep.turns
        for k, (action, obs) in enumerate(env.steps):
            end = at + ep.mask[at:].index(0) if 0 in ep.mask[at:] else len(ep.tokens)
            turn = ep.tokens[at:end]
            text, calls = chat.parse_tools(chat.decode(turn))
            assert isinstance(action, ToolTurn) and action.text == text
            assert [(c.name, c.arguments, c.error) for c in action.calls] == [tuple(c) for c in calls]
            expected += turn
            if k < ep.turns - 1:
                expected += chat.closing(turn) + chat.observation_ids(obs)
                at = len(expected)
        assert ep.tokens == expected
        assert not any(ep.mask[:len(chat.prompt_ids(opening))])


def test_a_model_taught_to_call_the_calculator_solves_the_problem_through_the_rollout(tmp_path, qwen_tok):
    """A tiny decoder fitted to one tool-calling episode (the call, the tool's answer, the final
    answer) replays it greedily: the rollout parses its <tool_call>, the calculator answers with a
    tool message, and the answer that follows earns the reward."""
    import torch

    from policy.chat import Chat
    from policy.tiny import build_model

    chat = Chat(qwen_tok, tools=tools())
    env = CalculatorEnv(tool_calls=True)
    opening = env.reset(options={"problem": PROBLEM})[0]
    first = qwen_tok.encode(CALL, add_special_tokens=False) + [chat.end_of_turn]
    text, calls = chat.parse_tools(CALL)
    obs = env.step(ToolTurn(text, (ToolCall(*calls[0]),)))[0]
    assert obs == ({"role": "tool", "content": "84"},)
    second = qwen_tok.encode("answer: 84", add_special_tokens=False) + [chat.end_of_turn]
    prompt = chat.prompt_ids(opening)
    tokens = prompt + first + chat.observation_ids(obs) + second
    trained = [0] * len(tokens)
    for span_end, span in ((len(prompt) + len(first), first), (len(tokens), second)):
        trained[span_end - len(span):span_end] = [1] * len(span)

    model = build_model(qwen_tok, hidden=64, layers=2, seed=0)
    ids = torch.tensor([tokens])
    labels = torch.tensor([[t if m else -100 for t, m in zip(tokens, trained)]])
    at = torch.tensor([i - 1 for i, m in enumerate(trained) if m])  # positions that predict the model's tokens
    target = ids[0, at + 1]
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(300):  # until every model token wins its position by a margin, so greedy replays them
        out = model(input_ids=ids, labels=labels)
        logits = out.logits[0, at].detach()
        right = logits[torch.arange(len(target)), target]
        logits[torch.arange(len(target)), target] = -torch.inf
        if (right - logits.max(-1).values).min() > 2.0:
            break
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    else:
        pytest.fail(f"the model did not fit the episode (loss {out.loss.item():.3f})")
    path = save(tmp_path, model, qwen_tok)
    engine = TorchEngine(path, LoraSpec(rank=4), seed=0)
    try:
        result = evaluate(engine, load_chat(path, tools=tools()), lambda: CalculatorEnv(tool_calls=True),
                          [{"problem": PROBLEM}], max_new_tokens=64, max_tokens=2048)
    finally:
        engine.close()
    assert result == {"success_rate": 1.0, "reward_mean": 1.0, "turns_mean": 2.0, "episodes": 1}
