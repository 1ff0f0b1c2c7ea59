"""`--model` by name: a local directory or a Hugging Face Hub id, resolved once to a directory.

No test touches the network. A Hub id is resolved against a Hugging Face cache built here (the
layout `snapshot_download` reads: models--org--name/refs/main and snapshots/<revision>/), with
the built-in tiny model's files in it. Resolution runs in a subprocess, since huggingface_hub
reads HF_HUB_OFFLINE and HF_HUB_CACHE when it is imported; where offline mode is off, HF_ENDPOINT
points at a closed local port, so a request fails at once instead of reaching the Hub.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from policy.load import ModelNotFound, hub_snapshot_of, resolve_model

ROOT = Path(__file__).resolve().parents[2]
NO_HUB = "http://127.0.0.1:9"
"""An endpoint nothing listens on (the discard port): a request to it is refused at once."""
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str, model_dir: str, extra: dict[str, bytes] | None = None) -> Path:
    """A Hugging Face cache under `root` holding `repo` at REVISION with `model_dir`'s files (and
    `extra` ones); the snapshot's directory."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        shutil.copy(f, snapshot / f.name)
    for name, blob in (extra or {}).items():
        (snapshot / name).write_bytes(blob)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(REVISION)
    return snapshot


def resolve(name: str, cache: Path, offline: bool) -> subprocess.CompletedProcess:
    """`resolve_model(name)` in a fresh process with this cache, online (against NO_HUB) or not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_HUB_CACHE=str(cache), HF_ENDPOINT=NO_HUB, PYTHONPATH=str(ROOT))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    code = "import sys; from policy.load import resolve_model; print(resolve_model(sys.argv[1]))"
    return subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_a_hub_id_in_the_cache_resolves_to_its_snapshot_offline(tmp_path, tiny_model):
    snapshot = hub_cache(tmp_path / "hub", "org/tiny", tiny_model)
    run = resolve("org/tiny", tmp_path / "hub", offline=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(snapshot)
    from policy import Chat, load_tokenizer

    assert Chat(load_tokenizer(run.stdout.strip())).stop_ids  # a directory the parts load as it is


def test_a_cached_hub_id_resolves_when_the_hub_cannot_be_reached(tmp_path, tiny_model):
    snapshot = hub_cache(tmp_path / "hub", "org/tiny", tiny_model)
    run = resolve("org/tiny", tmp_path / "hub", offline=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(snapshot)


def test_an_uncached_hub_id_offline_says_how_to_get_it(tmp_path, tiny_model):
    hub_cache(tmp_path / "hub", "org/tiny", tiny_model)
    run = resolve("org/missing", tmp_path / "hub", offline=True)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("policy.load.ModelNotFound: --model org/missing: not in the Hugging Face cache"), last
    for words in ("HF_HUB_OFFLINE is set", "hf download org/missing", "pass its directory as --model",
                  "unset HF_HUB_OFFLINE", str(tmp_path / "hub")):
        assert words in last, last


def test_an_uncached_hub_id_with_the_hub_unreachable_names_the_network(tmp_path):
    run = resolve("org/missing", tmp_path / "hub", offline=False)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert f"--model org/missing: the Hub at {NO_HUB} could not be reached (ConnectError" in last, last
    assert "hf download org/missing" in last, last


def test_a_snapshot_without_safetensors_weights_is_refused(tmp_path, tiny_model):
    snapshot = hub_cache(tmp_path / "hub", "org/tiny", tiny_model)
    (snapshot / "model.safetensors").unlink()
    run = resolve("org/tiny", tmp_path / "hub", offline=True)
    assert run.returncode != 0
    assert "has no config.json or no .safetensors weights" in run.stderr, run.stderr[-2000:]


def test_a_local_directory_resolves_to_its_absolute_path(tmp_path, tiny_model, monkeypatch):
    shutil.copytree(tiny_model, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("ckpt") == str(tmp_path / "ckpt")  # the same path for every part, on every node
    assert resolve_model(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["/no/such/model", "./no-such-model", "runs/no/such/model"])
def test_a_path_that_does_not_exist_is_refused(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound, match=f"--model {name}: no such directory. Pass a Hugging Face checkpoint"):
        resolve_model(name)


def test_a_directory_without_config_is_refused(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="is not a Hugging Face model directory \\(no config.json in it\\)"):
        resolve_model(str(tmp_path / "weights"))


def test_a_snapshot_path_names_its_repository_revision_and_cache(tmp_path, tiny_model):
    snapshot = hub_cache(tmp_path / "hub", "org/tiny-model", tiny_model)
    assert hub_snapshot_of(snapshot) == ("org/tiny-model", REVISION, str(tmp_path / "hub"))
    assert hub_snapshot_of(tiny_model) is None
    assert hub_snapshot_of(tmp_path / "snapshots" / "x") is None  # not under models--...
