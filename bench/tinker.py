"""`python -m bench.tinker [--steps 10] [--datums 8] [--tokens 64]`: what the Tinker API costs.

The same training step, one `forward_backward` (cross-entropy) and one `optim_step`, timed two ways
in the same run on the same batch: through the `tinker` SDK against a `python -m launch.tinker`
process on loopback (protobuf encoding, HTTP, seq_id ordering, future polling), and called
directly on the service's trainer in this process (serve/trainer.py: the learner's log-probs and
PEFT adapters, no HTTP). The first step of each is a warm-up and not counted.

Ends with one JSON line: {"sdk_step_s": median, "direct_step_s": median, "ratio": sdk / direct, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def batch(n: int, tokens: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = [rng.integers(4, vocab, size=tokens + 1) for _ in range(n)]
    return [(row[:-1].tolist(), row[1:].astype(np.int64), np.ones(tokens, dtype=np.float32)) for row in rows]


def sdk_steps(url: str, key: str, model: str, rows, steps: int) -> list[float]:
    import tinker
    from tinker import types

    data = [types.Datum(model_input=types.ModelInput.from_ints(toks),
                        loss_fn_inputs={"target_tokens": tgt, "weights": w}) for toks, tgt, w in rows]
    times = []
    with tinker.ServiceClient(base_url=url, api_key=key) as client:
        tc = client.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        for _ in range(steps + 1):
            start = time.perf_counter()
            fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=1e-4))
            fb.result(), opt.result()
            times.append(time.perf_counter() - start)
    return times[1:]


def direct_steps(model_path: str, rows, steps: int) -> list[float]:
    from serve.trainer import LoraChoice, Trainer
    from serve.wire import Datum

    trainer = Trainer(model_path, threads=1)
    trainer.create("m0", LoraChoice(rank=8, seed=0))
    data = [Datum(toks, {"target_tokens": tgt, "weights": w}) for toks, tgt, w in rows]
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        trainer.forward_backward("m0", data, "cross_entropy", {}, forward_only=False)
        trainer.optim_step("m0", {"learning_rate": 1e-4})
        times.append(time.perf_counter() - start)
    return times[1:]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.tinker", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--logdir", default="runs/bench-tinker")
    args = parser.parse_args(argv)
    import torch

    from policy.load import resolve_model

    torch.set_num_threads(1)
    path = resolve_model(args.model)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    rows = batch(args.datums, args.tokens, vocab)
    key = os.environ.get("TINKER_API_KEY") or "tml-bench-" + os.urandom(8).hex()
    env = {**os.environ, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "1"}
    os.environ["TINKER_TELEMETRY"] = "0"
    proc = subprocess.Popen([sys.executable, "-m", "launch.tinker", "--port", "0", "--model", args.model,
                             "--logdir", args.logdir, "--threads", "1"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in proc.stdout:
            if "listening on " in line:
                url = line.split("listening on ")[1].strip()
                break
        if url is None:
            raise SystemExit("error: the service did not start")
        sdk = sdk_steps(url, key, args.model, rows, args.steps)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    direct = direct_steps(path, rows, args.steps)
    result = {"sdk_step_s": round(statistics.median(sdk), 4), "direct_step_s": round(statistics.median(direct), 4),
              "ratio": round(statistics.median(sdk) / statistics.median(direct), 3), "steps": args.steps,
              "datums": args.datums, "tokens": args.tokens, "model": args.model}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
