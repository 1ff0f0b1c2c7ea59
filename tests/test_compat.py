"""A torchvision that cannot load (what vLLM's CPU build brings from the package index) is named,
with the command that fixes it, before anything tries to load a model."""

import subprocess
import sys
import textwrap


def test_a_torchvision_that_cannot_load_is_named_with_its_fix(tmp_path):
    broken = tmp_path / "torchvision"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    code = textwrap.dedent("""
        from policy.compat import check_torchvision
        try:
            check_torchvision()
        except RuntimeError as exc:
            print(exc)
        else:
            print("no error")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": f"{tmp_path}:{'.'}", "PATH": ""}, cwd=".")
    assert "pip uninstall -y torchvision torchaudio torchcodec" in out.stdout, out.stderr
    assert "torchvision::nms" in out.stdout


def test_no_torchvision_or_a_working_one_passes():
    from policy.compat import check_torchvision

    check_torchvision()  # this environment's, as installed by `pip install -e '.[test]'`
