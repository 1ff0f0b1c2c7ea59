"""Chat rendering: an episode built turn by turn is what the model family's template renders.

Tokenizers are built here (tests/policy/templates.py) with the published templates of Qwen2.5,
Qwen3, Llama 3.1, Mistral-7B-Instruct-v0.3, Gemma-2 and Phi-3; nothing is downloaded.
"""

import pytest

from policy.chat import Chat
from tests.policy.templates import build_tokenizer

FAMILIES = ("qwen2.5", "qwen3", "llama3")


@pytest.fixture(scope="module")
def tokenizers():
    return {family: build_tokenizer(family) for family in FAMILIES}


def user(text):
    return {"role": "user", "content": text}


def tool(text):
    return {"role": "tool", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def play(chat, opening, turns):
    """The episode's tokens as the actor builds them: the prompt, then each model turn (its text's
    tokens and the end-of-turn token it stopped on) and the observation that follows it; also
    the whole conversation as messages, and where each model turn sits in the tokens."""
    tokens, messages, spans = chat.prompt_ids(opening), list(opening), []
    for text, obs in turns:
        model = chat.tokenizer.encode(text, add_special_tokens=False) + [chat.end_of_turn]
        spans.append((len(tokens), len(tokens) + len(model), model))
        tokens = tokens + model + chat.observation_ids(obs)
        messages += [assistant(text), *obs]
    return tokens, messages, spans


def rendered(tokenizer, messages, **kwargs):
    """The template's own rendering of the whole conversation, as text and as tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        **kwargs)["input_ids"]
    return text, list(ids)


OPENINGS = {"no system": [user("What is 12 * 7? Use the calculator.")],
            "system": [{"role": "system", "content": "You solve problems step by step."},
                       user("What is 12 * 7? Use the calculator.")]}
OBSERVATIONS = {"user": lambda k: [user(f"moved down\nwall right {k}")],
                "tool": lambda k: [tool(f"calc: 12 * {k} = {12 * k}")],
                "tool+user": lambda k: [tool(f"result {k}"), user("Go on.")]}


@pytest.mark.parametrize("observation", OBSERVATIONS)
@pytest.mark.parametrize("opening", OPENINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_an_episode_built_turn_by_turn_is_the_templates_rendering_token_for_token(
        tokenizers, family, opening, observation):
    tok = tokenizers[family]
    chat = Chat(tok)
    turns = [(f"Let me check: 12 * {k} = {12 * k}, so the answer is {12 * k}.", OBSERVATIONS[observation](k))
             for k in range(1, 4)]
    tokens, messages, spans = play(chat, OPENINGS[opening], turns)
    text, ids = rendered(tok, messages)
    assert tok.decode(tokens) == text
    assert tokens == ids
    for start, end, model in spans:
        assert tokens[start:end] == model and model[-1] == chat.end_of_turn


THINK = "<think>\nThe product of 12 and {k} is {p}.\n</think>\n\n"


def test_qwen3_drops_earlier_thinking_blocks_and_the_episode_keeps_the_models_tokens(tokenizers):
    """After a user observation Qwen3 renders earlier assistant turns without their <think> block;
    the episode holds the model's own tokens, so it is the template's rendering with exactly those
    blocks put back, and nothing else differs."""
    tok = tokenizers["qwen3"]
    chat = Chat(tok)
    turns = [(THINK.format(k=k, p=12 * k) + f"The answer is {12 * k}.", [user(f"Now times {k + 1}?")])
             for k in range(1, 4)]
    tokens, messages, spans = play(chat, OPENINGS["system"], turns)
    text, _ = rendered(tok, messages)
    episode = tok.decode(tokens)
    blocks = [THINK.format(k=k, p=12 * k) for k in range(1, 4)]
    assert all(b not in text for b in blocks)  # the template drops every one of them
    expected = text
    for k, block in enumerate(blocks, 1):
        answer = f"<|im_start|>assistant\nThe answer is {12 * k}."
        assert expected.count(answer) == 1
        expected = expected.replace(answer, f"<|im_start|>assistant\n{block}The answer is {12 * k}.")
    assert episode == expected
    assert tokens == list(tok(expected, add_special_tokens=False)["input_ids"])
    for (start, end, model), block in zip(spans, blocks):
        assert tokens[start:end] == model and tok.decode(model).startswith(block)
    without = episode
    for block in blocks:
        without = without.replace(block, "", 1)
    assert without == text


def test_qwen3_keeps_thinking_blocks_between_tool_calls_so_the_episode_is_its_rendering(tokenizers):
    """Turns after the last user query keep their reasoning in Qwen3's template (a tool-calling
    run): the episode is then the template's rendering token for token, thinking included."""
    tok = tokenizers["qwen3"]
    chat = Chat(tok)
    turns = [(THINK.format(k=k, p=12 * k) + f"calc 12 * {k}", [tool(f"calc: 12 * {k} = {12 * k}")])
             for k in range(1, 4)]
    tokens, messages, _ = play(chat, OPENINGS["no system"], turns)
    text, ids = rendered(tok, messages)
    assert "The product of 12 and 3 is 36." in text
    assert tok.decode(tokens) == text and tokens == ids


def test_qwen3_without_thinking_prompts_with_an_empty_block_that_earlier_turns_drop(tokenizers):
    tok = tokenizers["qwen3"]
    chat = Chat(tok, template_kwargs={"enable_thinking": False})
    empty = "<think>\n\n</think>\n\n"
    assert tok.decode(chat.prompt_ids(OPENINGS["system"])).endswith(f"<|im_start|>assistant\n{empty}")
    assert tok.decode(Chat(tok).prompt_ids(OPENINGS["system"])).endswith("<|im_start|>assistant\n")
    turns = [(f"The answer is {12 * k}.", [user(f"Now times {k + 1}?")]) for k in range(1, 4)]
    tokens, messages, _ = play(chat, OPENINGS["system"], turns)
    text, _ = rendered(tok, messages, enable_thinking=False)
    assert text.count(empty) == 1  # only the generation prompt keeps it
    expected = text.replace("<|im_start|>assistant\nThe", f"<|im_start|>assistant\n{empty}The")
    assert tok.decode(tokens) == expected
    assert tokens == list(tok(expected, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("family, eos, end", [("qwen2.5", "<|im_end|>", "<|im_end|>"),
                                              ("qwen3", "<|endoftext|>", "<|im_end|>"),
                                              ("llama3", "<|eot_id|>", "<|eot_id|>"),
                                              ("llama3", "<|end_of_text|>", "<|eot_id|>")])
def test_stop_tokens_begin_with_the_templates_end_of_turn_whatever_the_eos(family, eos, end):
    tok = build_tokenizer(family, eos=eos)
    chat = Chat(tok)
    eot, eos_id = tok.convert_tokens_to_ids(end), tok.convert_tokens_to_ids(eos)
    assert chat.end_of_turn == eot and chat.stop_ids[0] == eot
    assert chat.stop_ids == ((eot,) if eos_id == eot else (eot, eos_id))
    text = "<think>\nshort\n</think>\n\nmove down" if family == "qwen3" else "move down"
    ids = tok.encode(text, add_special_tokens=False)
    assert chat.decode(ids + [eot]) == text and chat.decode(ids + [eos_id]) == text
    # a turn cut by length, or one that ended on eos, is closed with the end-of-turn token
    assert chat.closing(ids) == [eot] and chat.closing(ids + [eos_id]) == ([] if eos_id == eot else [eot])
    assert chat.closing(ids + [eot]) == []


def test_the_built_in_policys_tokens_are_unchanged(chat):
    """The maze task and the warm-started built-in policy depend on these ids (computed with the
    chat rendering before end-of-turn detection existed)."""
    maze = ("start\ngoal: down down left left\nopen: up down left\nnew: up down left\n##..\n#.@#\n.#..\nG...")
    assert chat.prompt_ids([user(maze)]) == [
        2, 5, 110, 11, 110, 31, 39, 25, 36, 92, 109, 8, 109, 8, 109, 9, 109, 9, 110, 39, 40, 29, 38, 92, 109, 7,
        109, 8, 109, 9, 110, 38, 29, 47, 92, 109, 7, 109, 8, 109, 9, 110, 79, 79, 90, 90, 110, 79, 90, 98, 79,
        110, 90, 79, 90, 90, 110, 57, 90, 90, 90, 3, 2, 6, 110]
    wall = maze.replace("start", "wall right")
    assert chat.observation_ids([user(wall)]) == [
        2, 5, 110, 13, 109, 10, 110, 31, 39, 25, 36, 92, 109, 8, 109, 8, 109, 9, 109, 9, 110, 39, 40, 29, 38, 92,
        109, 7, 109, 8, 109, 9, 110, 38, 29, 47, 92, 109, 7, 109, 8, 109, 9, 110, 79, 79, 90, 90, 110, 79, 90,
        98, 79, 110, 90, 79, 90, 90, 110, 57, 90, 90, 90, 3, 2, 6, 110]
    assert chat.prompt_ids([{"role": "system", "content": "Solve it."}, user("go up")]) == [
        2, 4, 110, 69, 39, 36, 46, 29, 109, 33, 44, 90, 3, 2, 5, 110, 31, 39, 109, 7, 3, 2, 6, 110]
    assert chat.observation_ids([tool("wall"), user("moved left")]) == [
        2, 44, 39, 39, 36, 110, 13, 3, 2, 5, 110, 12, 109, 9, 3, 2, 6, 110]
    assert chat.stop_ids == (3,) and chat.end_of_turn == 3


CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
BAD = {
    "turn count in the system header": (
        "<|im_start|>system\nturn {{ (messages|length + 1) // 2 }}<|im_end|>\n" + CHATML + PROMPT,
        "not prefix-stable"),
    "a marker after the last message": (
        CHATML + "<|endoftext|>" + PROMPT, "not prefix-stable"),
    "numbered messages": (
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        + PROMPT, "not prefix-stable"),  # the generation prompt's header is not the turn's "assistant 2"
    "turns ended by plain text": (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}", "does not close the assistant's content"),
    "no generation prompt": (CHATML, "generation prompt"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_template_that_cannot_be_rendered_turn_by_turn_fails_at_construction(case):
    template, message = BAD[case]
    tok = build_tokenizer("qwen2.5")
    tok.chat_template = template
    with pytest.raises(ValueError, match=message) as info:
        Chat(tok)
    assert "test-qwen2.5" in str(info.value)


def test_a_tokenizer_without_a_chat_template_fails_at_construction():
    tok = build_tokenizer("llama3")
    tok.chat_template = None
    with pytest.raises(ValueError, match="test-llama3 has no chat template.*instruct"):
        Chat(tok)


def test_a_template_that_refuses_the_tool_role_is_accepted_for_environments_that_send_none():
    tok = build_tokenizer("qwen2.5")
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}"
                         "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" + PROMPT)
    chat = Chat(tok)
    assert len(chat.skipped) == 2 and all("no tool role" in s for s in chat.skipped)
    assert tok.decode(chat.observation_ids([user("ok")])) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"


def test_the_rollout_closes_a_turn_cut_by_length_before_the_observation(tiny_model, chat):
    """The torch engine's turns of 2 tokens mostly end by length: each one that is followed by an
    observation gets the end-of-turn token (mask 0, log-prob 0) before it."""
    from actors.engine import SamplingParams
    from actors.torch_engine import TorchEngine
    from actors.envrunner import EnvRunner
    from actors.rollout import play as play_episodes
    from actors.rollout import start
    from envs import make_env
    from policy.load import LoraSpec

    engine, runner = TorchEngine(tiny_model, LoraSpec(rank=4), seed=5), EnvRunner(threads=2)
    try:
        episodes = [start(make_env("maze", max_steps=4), chat, runner, seed=i, sampling_seed=i) for i in range(4)]
        play_episodes(engine, chat, episodes, SamplingParams(2, chat.stop_ids, temperature=1.0), 512, runner)
    finally:
        runner.close()
        engine.close()
    closed = 0
    for ep in episodes:
        assert ep.finish_reason in ("terminated", "truncated"), ep.error
        ends = [i for i in range(1, len(ep.mask)) if ep.mask[i - 1] == 1 and ep.mask[i] == 0]
        assert len(ends) == ep.turns - 1  # every turn but the last is followed by an observation
        for i in ends:
            if ep.tokens[i - 1] == chat.end_of_turn:  # the model stopped: nothing added
                assert ep.tokens[i] != chat.end_of_turn
            else:
                assert ep.tokens[i] == chat.end_of_turn and ep.logprobs[i] == 0.0
                closed += 1
    assert closed > 0, "no turn was cut by length"


# Families whose templates have no generation prompt (Mistral: the model writes right after
# [/INST], its first token carrying the space the template puts there) or end a conversation with
# eos when none is asked (Phi-3); Gemma-2 allows no system and no tool role. What each renders
# turn by turn, and what it cannot.
MORE = {"mistral": (" ", ["no system"]), "gemma2": ("", ["no system"]), "phi3": ("", ["no system", "system"])}


@pytest.mark.parametrize("family, opening", [(f, o) for f, (_, openings) in MORE.items() for o in openings])
def test_mistral_gemma2_and_phi3_episodes_built_turn_by_turn_are_their_renderings(family, opening):
    tok = build_tokenizer(family)
    chat = Chat(tok)
    lead = MORE[family][0]
    tokens, messages = chat.prompt_ids(OPENINGS[opening]), list(OPENINGS[opening])
    for k in range(1, 4):
        text = f"Let me check: 12 * {k} = {12 * k}, so the answer is {12 * k}."
        model = tok.encode(lead + text, add_special_tokens=False) + [chat.end_of_turn]  # what the model writes
        obs = OBSERVATIONS["user"](k)
        tokens = tokens + model + chat.observation_ids(obs)
        messages += [assistant(text), *obs]
    text, ids = rendered(tok, messages)
    assert tok.decode(tokens) == text
    assert tokens == ids
    if family == "mistral":
        assert text.endswith("[INST] moved down\nwall right 3[/INST]")  # no generation prompt: the model writes on
    if family == "phi3":  # without a generation prompt Phi-3 ends the conversation with eos: not in the episode
        assert tok.apply_chat_template(messages, tokenize=False).endswith("<|end|>\n<|endoftext|>")
        assert chat.stop_ids == (tok.convert_tokens_to_ids("<|end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))


def test_what_a_family_cannot_render_turn_by_turn_stops_the_episode_with_a_message():
    mistral = Chat(build_tokenizer("mistral"))  # folds the system message into the last user turn
    with pytest.raises(ValueError, match="test-mistral cannot render messages of role 'system' turn by turn.*"
                                         "not prefix-stable"):
        mistral.prompt_ids(OPENINGS["system"])
    phi3 = Chat(build_tokenizer("phi3"))  # renders nothing for a tool message: the model would never see it
    assert "system" not in phi3.refused
    with pytest.raises(ValueError, match="test-phi3 cannot render messages of role 'tool' turn by turn.*leaves "
                                         "messages of role 'tool' out of the conversation"):
        phi3.observation_ids(OBSERVATIONS["tool"](1))
    gemma2 = Chat(build_tokenizer("gemma2"))  # refuses the system role itself: the template's own error
    assert gemma2.refused == {} and any("System role not supported" in s for s in gemma2.skipped)
    with pytest.raises(Exception, match="System role not supported"):
        gemma2.prompt_ids(OPENINGS["system"])


def test_a_template_whose_prompt_lacks_the_assistant_header_is_still_refused():
    tok = build_tokenizer("mistral")
    tok.chat_template = tok.chat_template.replace('{{- " " + message["content"]|trim + eos_token}}',
                                                  '{{- "Assistant: " + message["content"]|trim + eos_token}}')
    with pytest.raises(ValueError, match="renders 'Assistant: ' after the prompt, before the model's answer"):
        Chat(tok)
