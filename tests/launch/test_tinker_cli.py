"""`python -m launch.tinker`'s flags: the key it needs, the flags it refuses, a thin --help."""

import subprocess
import sys
from pathlib import Path

import pytest

from launch.tinker import TinkerArgs, api_key

ROOT = Path(__file__).resolve().parents[2]


def test_the_api_key_comes_from_the_variable_or_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="export TINKER_API_KEY"):
        api_key(TinkerArgs())
    monkeypatch.setenv("TINKER_API_KEY", "secret")
    with pytest.raises(SystemExit, match="must start with 'tml-'"):
        api_key(TinkerArgs())
    monkeypatch.setenv("TINKER_API_KEY", "tml-a")
    assert api_key(TinkerArgs()) == "tml-a"
    (tmp_path / "key").write_text("tml-from-file\n")
    assert api_key(TinkerArgs(api_key_file=str(tmp_path / "key"))) == "tml-from-file"
    with pytest.raises(SystemExit, match="--api-key-file"):
        api_key(TinkerArgs(api_key_file=str(tmp_path / "missing")))


@pytest.mark.parametrize("flags, message", [({"learners": 0}, "at least 1"), ({"port": 70000}, "no TCP port"),
                                            ({"poll_s": 50.0}, "45 s")])
def test_bad_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        TinkerArgs(**flags)


def test_help_answers_without_loading_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.argv = ['x', '--help']\n"
                          "try:\n    runpy.run_module('launch.tinker', run_name='__main__', alter_sys=True)\nexcept SystemExit:\n    pass\n"
                          "print('torch' in sys.modules)"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "--api-key-file" in out.stdout and out.stdout.strip().endswith("False"), out.stdout + out.stderr
