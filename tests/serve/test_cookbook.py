"""Two tinker-cookbook recipes, unchanged, train against a real `python -m launch.tinker`.

The cookbook (0.6.1) declares `tml-renderers>=0.4.1`, which the package index lacks; it imports
that package only for Thinking Machines' own model families, never for `role_colon` or these
recipes, so it installs with `pip install --no-deps tinker-cookbook==0.6.1` beside its other
dependencies (the `cookbook` extra, in the test extra; .ci/run does both). Offline: the model's
name is its local directory, so the cookbook's tokenizer loads from disk; telemetry is off."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve.conftest import KEY, ROOT, start_service

cookbook = pytest.importorskip(
    "tinker_cookbook", reason="tinker-cookbook is absent: pip install -e '.[cookbook]' && "
    "pip install --no-deps tinker-cookbook==0.6.1 (its tml-renderers pin has no release on the index)")
pytest.importorskip("math_verify", reason="the math_rl recipe needs math-verify: pip install -e '.[cookbook]'")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    s = start_service(tiny_model, tmp_path_factory.mktemp("cookbook"))
    yield s
    s.stop()


def recipe(served, module: str, log_path: Path, *args: str) -> list[dict]:
    """Run `python -m <module> ...` as a user would; the metrics lines it wrote."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", module, f"base_url={served.url}", f"log_path={log_path}",
                          "behavior_if_log_dir_exists=delete", *args],
                         capture_output=True, text=True, env=env, cwd=log_path.parent, timeout=1500)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:], served.log.read_text()[-3000:])
    assert "Training completed successfully" in out.stdout + out.stderr
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_chat_sl_recipe_loss_falls(served, tiny_model, tmp_path):
    data = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    rows = recipe(served, "tinker_cookbook.recipes.chat_sl.train", tmp_path / "sl", f"model_name={tiny_model}",
                  "renderer_name=role_colon", f"dataset={data}", "batch_size=16", "max_steps=6", "lora_rank=8",
                  "learning_rate=1e-3", "save_every=0", "eval_every=0")
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 6 and all(n == n for n in nll), rows
    assert nll[-1] < nll[0] - 0.1, nll


def test_math_rl_arithmetic_recipe_completes_steps(served, tiny_model, tmp_path):
    rows = recipe(served, "tinker_cookbook.recipes.math_rl.train", tmp_path / "rl", f"model_name={tiny_model}",
                  "env=arithmetic", "renderer_name=role_colon", "loss_fn=importance_sampling", "group_size=4",
                  "groups_per_batch=4", "max_steps=3", "lora_rank=8", "save_every=0", "eval_every=0")
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert [r["step"] for r in steps] == [0, 1, 2], rows
    # the sampler's log-probs and the trainer's agree: the KL between them is ~0
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-3 for r in steps), steps
