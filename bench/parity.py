"""`python -m bench.parity`: do the engines' behaviour log-probs match the learner's?

On the built-in model, with the same prompts and the same adapter (random LoRA
weights, large enough to move every log-prob), each engine samples completions
at the training temperature and records log μ of every token it sampled. The
learner's scoring of the same tokens (the policy with the adapter, a plain
forward, `learner.losses.token_logprobs` at the same temperature) gives log π.
Reported per engine: the mismatch KL(μ ‖ π) the learner logs
(`learner.losses.mismatch_kl`) and the largest |log μ − log π| over all tokens.
The image path beside it: the built-in tiny vision-language model on image-maze
opening prompts (one picture each), scored with the pictures as the learner does.
In float32 on CPU both should be about 1e-4 or less; in bf16 on a GPU they are
larger, and the staleness corrections cover the difference.

Ends with one JSON line: {"torch_max_abs": ..., "torch_kl": ..., "torch_image_max_abs": ...,
"torch_image_kl": ..., "vllm_max_abs": ..., ...} (the vLLM keys only where vLLM is installed).
"""

from __future__ import annotations

import argparse
import json


def random_adapter(model_path: str, lora, seed: int = 0, scale: float = 0.2) -> dict:
    """A PEFT adapter for `model_path` with random A and B (a fresh adapter is the identity)."""
    import torch
    from peft import get_peft_model_state_dict

    from policy.load import load_model, with_lora

    gen = torch.Generator().manual_seed(seed)
    state = get_peft_model_state_dict(with_lora(load_model(model_path), lora))
    return {k: torch.randn(v.shape, generator=gen) * scale for k, v in state.items()}


def learner_logprobs(model_path: str, lora, tensors: dict, sequences: list[list[int]],
                     temperature: float, device: str = "cpu", dtype: str = "float32",
                     images: list[list] | None = None) -> list[list[float]]:
    """log π of every token of each sequence (entry t: of token t given the ones before; 0 at t = 0),
    scored as the learner scores: the policy with the adapter, computing in `dtype` on `device`
    (as the learner's mixed precision does: every weight, the adapter's too, cast to it), log-probs
    from the last hidden state in float32 (learner/logprobs.py)."""
    import torch
    from peft import set_peft_model_state_dict

    from learner.logprobs import model_terms
    from policy.load import load_model, with_lora
    from policy.vision import batch_positions, scheme_for

    model = with_lora(load_model(model_path), lora).eval()
    set_peft_model_state_dict(model, tensors)
    model.to(device=device, dtype=getattr(torch, dtype))
    scheme = scheme_for(model_path)
    banned = scheme.special_ids if scheme is not None else ()
    out = []
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            ids = torch.tensor([seq], device=device)
            pixels = scheme.pixels([images[i]], device) if images is not None else None
            positions = batch_positions(scheme, ids, [len(seq)], [images[i]]) if images is not None else None
            if positions is not None:  # M-RoPE (Qwen-VL)
                pixels["position_ids"] = positions
            logp, _ = model_terms(model, ids, torch.ones_like(ids), temperature, pixels=pixels, banned=banned)
            out.append(logp[0].tolist())
    return out


def compare(engine, model_path: str, lora, tensors: dict, prompts: list[list[int]], params,
            device: str = "cpu", dtype: str = "float32", images: list[list] | None = None) -> dict:
    """Sample `prompts` (with their `images`) with `engine` (adapter `tensors` applied as
    version 1) and compare its log μ with the learner's log π of the same tokens (scored in
    `dtype` on `device`)."""
    import torch

    from learner.losses import mismatch_kl

    if engine.version < 1:
        engine.load_adapter(1, tensors)
    outs = engine.generate(prompts, params, **({"images": images} if images is not None else {}))
    scored = learner_logprobs(model_path, lora, tensors, [p + o.tokens for p, o in zip(prompts, outs)],
                              params.temperature, device, dtype, images)
    mu = torch.tensor([lp for o in outs for lp in o.logprobs], dtype=torch.float64)
    pi = torch.tensor([s[len(p) + j] for p, o, s in zip(prompts, outs, scored) for j in range(len(o.tokens))],
                      dtype=torch.float64)
    return {"max_abs": float((mu - pi).abs().max()),
            "kl": mismatch_kl(pi, mu, torch.ones_like(mu)),
            "tokens": int(mu.numel()),
            "sequences": [(p, o.tokens, o.logprobs) for p, o in zip(prompts, outs)]}


def prompts_for(chat, n: int) -> list[list[int]]:
    """`n` different maze-like opening prompts."""
    from envs.maze import MazeEnv

    env = MazeEnv()
    out = []
    for seed in range(n):
        messages, _ = env.reset(seed=seed)
        out.append(chat.prompt_ids(messages))
    return out


def image_prompts_for(chat, n: int) -> tuple[list[list[int]], list[list]]:
    """`n` different image-maze opening prompts and their pictures (one each)."""
    from envs.image_maze import ImageMazeEnv
    from policy.chat import message_images

    env = ImageMazeEnv()
    prompts, images = [], []
    for seed in range(n):
        messages, _ = env.reset(seed=seed)
        prompts.append(chat.prompt_ids(messages))
        images.append(message_images(messages))
    return prompts, images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per completion")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--engines", default="torch,vllm")
    args = parser.parse_args()

    import importlib.util

    import torch

    from actors.engine import SamplingParams
    from actors.engines import make_engine
    from policy.load import load_chat, resolve_model
    from policy.load import LoraSpec

    torch.set_num_threads(1)
    lora = LoraSpec()
    result = {}
    for path_name, builtin in (("", "builtin:tiny"), ("_image", "builtin:tiny-vlm")):
        model_path = resolve_model(builtin)
        chat = load_chat(model_path)
        tensors = random_adapter(model_path, lora)
        if chat.scheme is None:
            prompts, images = prompts_for(chat, args.prompts), None
        else:
            prompts, images = image_prompts_for(chat, args.prompts)
        params = SamplingParams(args.tokens, chat.stop_ids, temperature=args.temperature)
        for kind in args.engines.split(","):
            if kind == "vllm" and importlib.util.find_spec("vllm") is None:
                print("vllm: not installed, skipped")
                continue
            engine = make_engine(kind, model_path, lora, dtype="float32")
            try:
                r = compare(engine, model_path, lora, tensors, prompts, params, images=images)
            finally:
                engine.close()
            what = "images" if images is not None else "text"
            print(f"{kind} ({what}): {r['tokens']} tokens, max |log μ − log π| {r['max_abs']:.2e}, "
                  f"mismatch KL {r['kl']:.2e}")
            result[f"{kind}{path_name}_max_abs"], result[f"{kind}{path_name}_kl"] = r["max_abs"], r["kl"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
