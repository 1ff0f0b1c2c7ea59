"""A whole job in tool-call mode, as a user would run it: `--env calculator --calculator.tool-calls`
on a local model directory holding a small random Qwen2.5-architecture model with Qwen2.5's chat
template (tests/policy/templates.py). Every prompt the actors render declares the environment's
tool in the template's own format, every reply is parsed with the family's parser (the random
model's noise included: no episode breaks), and the learner trains on those tokens."""

import subprocess
import sys
from pathlib import Path

import pytest

from launch.plot import read_scalars
from replay.log import groups
from tests.policy.templates import build_tokenizer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_calculator_in_tool_call_mode_trains_end_to_end(tmp_path):
    from policy.tiny import build_model

    tokenizer = build_tokenizer("qwen2.5")
    model = tmp_path / "model"
    build_model(tokenizer, hidden=32, layers=2, seed=1).save_pretrained(model)
    tokenizer.save_pretrained(model)
    logdir = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "launch.async", "--model", str(model), "--env", "calculator", "--calculator.tool-calls",
         "--actors", "1", "--learners", "2", "--steps", "2", "--eval-episodes", "4", "--learner.groups-per-step", "2",
         "--actor.group-size", "4", "--actor.max-new-tokens", "24", "--replay.keep-log", "--logdir", str(logdir)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 2 steps" in run.stdout

    scalars = read_scalars(str(logdir))
    assert [s for s, _ in scalars["learner/step"]] == [1, 2]
    assert all(v == 0 for _, v in scalars["rollout/env_errors"])
    trajectories = [t for g in groups(logdir / "replay-log") for t in g.trajectories]
    assert trajectories and all(t.finish_reason != "env_error" for t in trajectories)
    for t in trajectories:
        first_turn = int(t.mask.argmax())
        prompt = tokenizer.decode(t.tokens[:first_turn].tolist())
        # the tool, declared as Qwen2.5's template declares tools, and no `calc:` text command
        assert "<tools>" in prompt and '"name": "calculate"' in prompt and "calc:" not in prompt, prompt
        assert t.reward in (0.0, 1.0)
    # the replies went through the tool-call path: the random model's turns are parsed into tool
    # calls (none, or malformed ones), so the environment answers in tool-call mode's words or with
    # the template's tool messages, never with the text mode's `calc:` instructions
    later = [t for t in trajectories if t.turns > 1]
    assert later, [(t.turns, t.finish_reason) for t in trajectories]
    for t in later:
        first_turn = int(t.mask.argmax())
        rest = zip(t.tokens[first_turn:].tolist(), t.mask[first_turn:])
        observed = tokenizer.decode([tok for tok, m in rest if not m])
        assert "No tool call or answer found" in observed or "<tool_response>" in observed, observed
        assert "No command found" not in observed, observed
