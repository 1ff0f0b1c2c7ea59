"""The built-in models' cache: one builder at a time, whole entries only, however many runs start together."""

import errno
import fcntl
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from policy.cache import build_once

ROOT = Path(__file__).resolve().parents[2]

# Two runs asking for the built-in tiny model at the same moment: each loads everything a build
# needs, says it is ready, and waits for the start line, so that both ask before either has
# finished building. Each build is recorded (save_tiny, wrapped).
RUN_ASKING_FOR_TINY = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path

    import policy.tiny
    import transformers  # noqa: F401 - loaded before the start line, not during the race

    save_tiny = policy.tiny.save_tiny

    def recorded(path):
        with open(os.environ["BUILDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        return save_tiny(path)

    policy.tiny.save_tiny = recorded
    from policy.load import resolve_model

    go, ready = Path(sys.argv[1]), Path(sys.argv[2])
    ready.touch()
    while not go.exists():
        time.sleep(0.001)
    print(resolve_model("builtin:tiny"))
""")


def test_two_runs_building_the_tiny_model_at_once_share_one_whole_build(tmp_path):
    cache, builds, go = tmp_path / "cache", tmp_path / "builds", tmp_path / "go"
    env = {**os.environ, "TANDEM_CACHE": str(cache), "BUILDS": str(builds), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    runs = [subprocess.Popen([sys.executable, "-c", RUN_ASKING_FOR_TINY, str(go), str(r)], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    try:
        deadline = time.time() + 300
        while not all(r.exists() for r in ready):
            assert time.time() < deadline and all(p.poll() is None for p in runs), "a run did not start"
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=300) for p in runs]
    finally:
        for p in runs:
            p.kill()
    for p, (out, err) in zip(runs, outs):
        assert p.returncode == 0, err[-3000:]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert paths == {str(cache / "tiny-v1")}
    assert len(builds.read_text().split()) == 1, "both runs built the model"
    assert sorted(p.name for p in cache.iterdir()) == [".tiny-v1.lock", "tiny-v1"], "a temporary build was left"
    from policy.load import load_model, load_tokenizer

    path = paths.pop()
    assert load_tokenizer(path).chat_template and load_model(path).config.num_hidden_layers == 4


def _write_entry(path: Path, who: str) -> None:
    path.mkdir(exist_ok=True)
    (path / "weights").write_text(who)
    (path / "config.json").write_text("{}")


def test_an_entry_is_built_once_and_then_found(tmp_path):
    calls = []
    for _ in range(2):
        out = build_once(tmp_path / "m", lambda tmp: (calls.append(tmp), _write_entry(tmp, "a")))
    assert out == tmp_path / "m" and len(calls) == 1 and (out / "weights").read_text() == "a"


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    def fail(tmp):
        _write_entry(tmp, "half")
        raise RuntimeError("killed halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        build_once(tmp_path / "m", fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock"]
    with pytest.raises(RuntimeError, match="wrote no config.json"):
        build_once(tmp_path / "m", lambda tmp: None)
    assert not (tmp_path / "m").exists()


def test_something_else_in_the_way_is_named(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="in the way"):
        build_once(tmp_path / "m", lambda tmp: _write_entry(tmp, "a"))
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"


def test_without_flock_the_rename_settles_a_race(tmp_path, monkeypatch):
    """Where the filesystem has no flock, two builders run side by side: both finish, the first
    rename wins, the second finds the entry filled (the rename fails) and keeps it."""
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    both_built = threading.Barrier(2, timeout=30)
    results, errors = {}, []

    def builder(who):
        def build(tmp):
            _write_entry(tmp, who)
            both_built.wait()  # neither renames before both have built

        try:
            results[who] = build_once(tmp_path / "m", build)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=builder, args=(w,)) for w in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {"a": tmp_path / "m", "b": tmp_path / "m"}
    assert (tmp_path / "m" / "weights").read_text() in ("a", "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]
