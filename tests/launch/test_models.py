"""`--model` at the driver and on the nodes: one clear error before Ray starts for a model that is
not there or cannot chat turn by turn, the user's Hugging Face settings passed through (never
offline mode forced), and a Hub snapshot fetched by a node that lacks it.

No test touches the network (HF_HUB_OFFLINE is set for the test process: tests/conftest.py).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from launch import cluster
from tests.policy.test_load import REVISION, hub_cache

ROOT = Path(__file__).resolve().parents[2]


def launch(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.async", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_a_model_path_that_does_not_exist_stops_the_job_before_anything_starts(tmp_path):
    run = launch("--model", "/nonexistent", cwd=tmp_path)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.strip() == ("error: --model /nonexistent: no such directory. Pass a Hugging Face checkpoint "
                                  "directory (with config.json) or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct")
    assert not (tmp_path / "runs").exists()  # no run directory for a run that never started


def test_a_hub_id_missing_from_the_cache_offline_stops_the_job_with_what_to_do(tmp_path):
    run = launch("--model", "org/missing", cwd=tmp_path,
                 env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.startswith("error: --model org/missing: not in the Hugging Face cache"), run.stderr
    assert "hf download org/missing" in run.stderr and "Traceback" not in run.stderr


def test_a_model_whose_chat_template_cannot_be_rendered_stops_the_job_at_start(tmp_path, tiny_model):
    model = tmp_path / "no-template"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    run = launch("--model", str(model), cwd=tmp_path)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.startswith("error: ") and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "template" in run.stderr, run.stderr
    assert not (tmp_path / "runs").exists()


def test_the_user_s_hugging_face_settings_reach_the_parts_and_nothing_else(monkeypatch):
    for name in cluster.HF_VARS:
        monkeypatch.delenv(name, raising=False)
    assert cluster.hf_env() == {}  # offline mode is never forced on the parts
    monkeypatch.setenv("HF_HOME", "/data/hf")
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cluster.hf_env() == {"HF_HOME": "/data/hf", "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "1"}


def test_a_node_without_the_driver_s_hub_snapshot_fetches_it_or_says_why_not(tmp_path, tiny_model):
    snapshot = hub_cache(tmp_path / "hub", "org/tiny", tiny_model, extra={"pytorch_model.bin": b"x" * 10})
    manifest = cluster.manifest(str(snapshot))
    assert manifest["hub"] == ("org/tiny", REVISION, str(tmp_path / "hub")) and manifest["data"] is None
    assert "pytorch_model.bin" not in manifest["files"]  # no node needs what Tandem does not load
    (snapshot / "pytorch_model.bin").unlink()
    assert cluster.inspect_node("maze", manifest)["problems"] == []  # the same files as far as Tandem reads
    shutil.rmtree(tmp_path / "hub")  # as on a node that never downloaded it; offline here, so it cannot
    [problem] = cluster.inspect_node("maze", manifest)["problems"]
    assert problem.startswith(f"the model org/tiny (revision {REVISION}) is not in this node's Hugging Face "
                              f"cache {tmp_path / 'hub'} and could not be fetched: --model org/tiny: "), problem
    assert "HF_HUB_OFFLINE is set" in problem
