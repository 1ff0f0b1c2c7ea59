"""A real model family end to end, as a user would run it: `--model Qwen/...` (a Hub id, read
from the Hugging Face cache offline) naming a Qwen3-architecture model with Qwen3's published
chat template, whose end of turn (<|im_end|>) is not the tokenizer's eos (<|endoftext|>). The
model is small and randomly initialised (nothing is downloaded), so it writes noise: the
countdown environment answers every wrong turn with feedback and another try, which makes
episodes of several turns.

What it shows: the learner, loaded from the snapshot on the meta device, trains on exactly the
tokens the actors rendered turn by turn; no episode ends in env_error (a template that could not
be rendered incrementally used to end every episode after its first turn that way); each turn
the model ended itself ends on the end-of-turn token it sampled, a turn cut by length is closed
with that token unsampled, and every observation starts as the template renders it after a turn.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch.plot import read_scalars
from replay.log import groups
from tests.policy.templates import build_tokenizer
from tests.policy.test_load import NO_HUB, hub_cache

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REPO = "Qwen/Qwen3-tiny-test"


def qwen3_model(path: Path):
    """A Qwen3-architecture model of a few layers with random weights and Qwen3's template."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer("qwen3", eos="<|endoftext|>")
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def turns_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of model tokens (mask 1)."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_a_qwen3_model_by_hub_id_trains_on_the_tokens_its_template_renders(tmp_path, thinking):
    from policy import Chat

    tokenizer = qwen3_model(tmp_path / "model")
    options = [] if thinking else ["--chat-template-kwargs", '{"enable_thinking": false}']
    chat = Chat(tokenizer, {} if thinking else {"enable_thinking": False})
    eot, eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert chat.stop_ids == (eot, eos)
    cache = tmp_path / "hub"
    hub_cache(cache, REPO, str(tmp_path / "model"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_ENDPOINT=NO_HUB, PYTHONPATH=str(ROOT))
    logdir = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "launch.async", "--model", REPO, "--env", "countdown", "--actors", "1",
         "--learners", "2", "--steps", "2", "--eval-episodes", "4", "--learner.groups-per-step", "2",
         "--actor.group-size", "4", "--actor.max-new-tokens", "12", "--replay.keep-log", "--logdir", str(logdir), *options],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 2 steps" in run.stdout

    scalars = read_scalars(str(logdir))
    assert [s for s, _ in scalars["learner/step"]] == [1, 2]
    assert all(v == 0 for _, v in scalars["rollout/env_errors"])

    trajectories = [t for g in groups(logdir / "replay-log") for t in g.trajectories]
    assert trajectories and not [t.finish_reason for t in trajectories if t.finish_reason == "env_error"]
    # the generation prompt: Qwen3's template writes an empty thinking block into it when thinking is off
    header = tokenizer.encode("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    after_turn = tokenizer.encode("\n<|im_start|>user")  # what the template writes after <|im_end|>
    cut = 0
    for t in trajectories:
        tokens = t.tokens.tolist()
        spans = turns_of(t.mask)
        assert spans and all(tokens[:start][-len(header):] == header for start, _ in spans)
        for start, end in spans:
            turn = tokens[start:end]
            assert all(x not in chat.stop_ids for x in turn[:-1])  # the engine stopped at the first stop token
            if end == len(tokens):
                continue  # the episode's last turn
            if turn[-1] == eot:  # the model closed its turn itself: the observation follows at once
                rest = tokens[end:]
            else:
                cut += 1  # cut by length (or ended on eos): closed with <|im_end|>, not trained on
                assert tokens[end] == eot and t.mask[end] == 0 and t.logprobs[end] == 0
                rest = tokens[end + 1:]
            assert rest[:len(after_turn)] == after_turn, tokenizer.decode(rest[:8])
    assert cut > 0  # a random model rarely samples <|im_end|> within 12 tokens
