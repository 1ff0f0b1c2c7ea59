"""The vLLM checks of `python -m bench.gpu_check` (one CUDA device; each in a fresh process).

  colocated     one NCCL learner rank and a vLLM engine in sleep mode on the same GPU, three
                cycles of: empty the learner's cache, check the room (actors/gpu_memory.py
                `check_wake`), wake, load the published adapter, greedy-generate, sleep and wake
                again and greedy-generate (the tokens must be equal: an adapter silently not
                applied after a wake would change them), sleep, two learner steps of --rows ×
                --tokens tokens. Logs `memory_reserved` and the free memory before each wake.
  parity_vllm   vLLM's log μ in bf16 at temperature 0.7 with a random adapter against the learner's
                log π of the same tokens (bench/parity.py): max |Δ log p| and the mismatch KL.
  two_engines   two vLLM engines started at once on one GPU, each given half of it with the
                fraction Tandem allows (`largest_shared_fraction`): both start (one after the
                other, by the GPU's lock) and generate.

The built-in tiny policy throughout (vLLM serves it; nothing is downloaded): the memory figures
are those of the mechanism, not of a large model. Without CUDA each check says so and is skipped.
"""

from __future__ import annotations

import threading

from launch.colocate import greedy_equal

GIB = 1 << 30


def skipped(device: str) -> dict | None:
    """Why the vLLM checks cannot run here (None when they can): they need CUDA and vLLM's CUDA build."""
    import importlib.util

    if device != "cuda":
        return {"skipped": "needs CUDA (vLLM's sleep mode and GPU memory)"}
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed: pip install -e '.[vllm]'"}
    return None


def colocated(rows: int, tokens: int, cycles: int = 3, fraction: float = 0.3) -> dict:
    import socket

    import torch

    from actors.engine import SamplingParams
    from actors.engines import make_engine
    from actors.gpu_memory import check_start_beside, check_wake
    from bench.model_step import synthetic_group
    from bench.parity import prompts_for
    from learner.config import LearnerConfig
    from learner.trainer import Learner
    from policy.load import LoraSpec, load_chat, resolve_model
    from replay.buffer import ReplayBuffer
    from replay.client import LocalReplay

    model_path, lora = resolve_model("builtin:tiny"), LoraSpec()
    chat = load_chat(model_path)
    replay = LocalReplay(ReplayBuffer(groups_per_step=1, max_staleness=1_000_000), actor="gpu-check")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    cfg = LearnerConfig(groups_per_step=1, micro_batch=rows, device="cuda", dtype="bfloat16", lr_schedule="constant")
    learner = Learner(cfg, model_path, 0, 1, url, replay)
    learner.setup()
    engine = None
    try:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        check_start_beside(fraction, free, total, torch.cuda.memory_reserved())
        engine = make_engine("vllm", model_path, lora, device="cuda", sleep_mode=True, memory_fraction=fraction,
                             max_model_len=2048, enforce_eager=True)
        prompts, greedy = prompts_for(chat, 4), SamplingParams(16, chat.stop_ids, temperature=0.0)
        vocab, length = learner.model.config.vocab_size, min(tokens, 2048)
        log, released = [], 0
        for cycle in range(cycles):
            reserved = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            if engine.asleep:
                check_wake(free, released, torch.cuda.memory_reserved(), total, fraction)
            engine.wake()
            adapter = learner.published
            if adapter.version > engine.version:
                engine.load_adapter(adapter.version, adapter.tensors)
            before = [c.tokens for c in engine.generate(prompts, greedy)]
            engine.sleep()
            engine.wake()
            greedy_equal(before, [c.tokens for c in engine.generate(prompts, greedy)])
            free0 = torch.cuda.mem_get_info()[0]
            engine.sleep()
            released = torch.cuda.mem_get_info()[0] - free0
            for step in range(2):
                replay.push(synthetic_group(vocab, rows, length, 100 * cycle + step, actor="gpu-check"))
                learner.step()
            log.append({"reserved_before_wake_gb": round(reserved / GIB, 3), "free_before_wake_gb": round(free / GIB, 3),
                        "released_at_sleep_gb": round(released / GIB, 3), "version": learner.version})
        return {"cycles": log, "greedy_equal_across_sleeps": True, "fraction": fraction}
    finally:
        if engine is not None:
            engine.close()
        learner.close()


def parity_vllm(prompts: int) -> dict:
    from actors.engine import SamplingParams
    from actors.engines import make_engine
    from bench.parity import compare, prompts_for, random_adapter
    from policy.load import LoraSpec, load_chat, resolve_model

    model_path, lora = resolve_model("builtin:tiny"), LoraSpec()
    chat = load_chat(model_path)
    engine = make_engine("vllm", model_path, lora, device="cuda", dtype="bfloat16", memory_fraction=0.3,
                         max_model_len=2048, enforce_eager=True)
    try:
        r = compare(engine, model_path, lora, random_adapter(model_path, lora), prompts_for(chat, prompts),
                    SamplingParams(16, chat.stop_ids, temperature=0.7), "cuda", "bfloat16")
    finally:
        engine.close()
    return {"max_abs": r["max_abs"], "kl": r["kl"], "tokens": r["tokens"]}


def two_engines() -> dict:
    import torch

    from actors.engine import SamplingParams
    from actors.engines import make_engine
    from actors.gpu_memory import largest_shared_fraction
    from policy.load import LoraSpec, load_chat, resolve_model

    model_path, lora = resolve_model("builtin:tiny"), LoraSpec()
    chat = load_chat(model_path)
    total = torch.cuda.mem_get_info()[1]
    fraction = largest_shared_fraction(0.5, total)
    engines, errors = [None, None], []

    def start(i: int) -> None:
        try:
            engines[i] = make_engine("vllm", model_path, lora, device="cuda", seed=i, memory_fraction=fraction,
                                     gpu_share=0.5, max_model_len=2048, enforce_eager=True)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"engine {i}: {exc!r}"[:400])

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise RuntimeError("; ".join(errors))
        prompt = chat.prompt_ids([{"role": "user", "content": "start"}])
        done = [len(e.generate([prompt], SamplingParams(8, chat.stop_ids, 0.7))[0].tokens) for e in engines]
        free = torch.cuda.mem_get_info()[0]
    finally:
        for e in engines:
            if e is not None:
                e.close()
    return {"fraction": fraction, "tokens": done, "free_after_gb": round(free / GIB, 3),
            "total_gb": round(total / GIB, 3)}
