"""SWE-bench / SWE-Gym rows on local files: the reader on rows written here, and a row played
through `--env code` and graded as SWE-bench grades, with pytest from this test's own Python
copied into a folder bound read-only into the sandbox (the environment as host folders)."""

import json
import os
import shutil
import subprocess

import pytest

from envs import make_env
from envs.swebench import SweTask, read_rows

SOURCE = "def add(a, b):\n    return a - b\n"
TESTS = ("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_zero():\n    assert add(0, 0) == 0\n")
TEST_PATCH = """diff --git a/test_new.py b/test_new.py
new file mode 100644
--- /dev/null
+++ b/test_new.py
@@ -0,0 +1,5 @@
+from calc import add
+
+
+def test_negative():
+    assert add(-1, -1) == -2
"""


def row(**over) -> dict:
    return {"instance_id": "demo__calc-1", "repo": "demo/calc", "problem_statement": "add() subtracts.",
            "base_commit": "",
            "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add", "test_new.py::test_negative"]),
            "PASS_TO_PASS": ["tests/test_calc.py::test_zero"], "test_patch": TEST_PATCH, "version": "0.1", **over}


@pytest.fixture
def repos(root):
    """A prepared checkout of the demo repository (a git repository at its base commit)."""
    repo = root / "repos" / "demo__calc-1"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(SOURCE)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "base"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(git[:3] + ["checkout", "-q", "--detach", head], check=True)
    return root / "repos", head


def write_rows(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_rows_are_read_from_jsonl_and_parquet(repos, tmp_path):
    folder, head = repos
    tasks = read_rows(write_rows(tmp_path / "rows.jsonl", [row(base_commit=head)]), str(folder))
    task = tasks[0]
    assert isinstance(task, SweTask) and task.instance_id == "demo__calc-1" and task.base_commit == head
    assert task.fail_to_pass == ("tests/test_calc.py::test_add", "test_new.py::test_negative")
    assert task.pass_to_pass == ("tests/test_calc.py::test_zero",)
    assert task.protected == {"test_new.py"}
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([row(base_commit=head, PASS_TO_PASS=json.dumps([]))])
    pq.write_table(table, tmp_path / "rows.parquet")
    assert read_rows(str(tmp_path / "rows.parquet"), str(folder))[0].pass_to_pass == ()


BAD_ROWS = {
    "missing fields": ({"instance_id": "demo__calc-1"}, r"row 1 lacks problem_statement, FAIL_TO_PASS, PASS_TO_PASS"),
    "no checkout": (row(instance_id="other__x-2"), r"no checkout .*other__x-2"),
    "another commit": (row(base_commit="f" * 40), r"is at .*base_commit is ffffffffffff.*git -C .* checkout"),
    "ids not a list": (row(FAIL_TO_PASS="tests/test_calc.py::test_add"), r"FAIL_TO_PASS must be a list"),
    "ids of numbers": (row(PASS_TO_PASS=[1, 2]), r"PASS_TO_PASS must be a list of test ids"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_rows_are_refused_with_what_is_wrong(case, repos, tmp_path):
    bad, match = BAD_ROWS[case]
    with pytest.raises(ValueError, match=match):
        read_rows(write_rows(tmp_path / "rows.jsonl", [bad]), str(repos[0]))


def test_missing_files_and_folders_are_named(repos, tmp_path):
    with pytest.raises(ValueError, match="--code.tasks .*no such file"):
        read_rows(str(tmp_path / "none.jsonl"), str(repos[0]))
    with pytest.raises(ValueError, match="--code.repos .*no such folder"):
        read_rows(write_rows(tmp_path / "rows.jsonl", [row()]), str(tmp_path / "nowhere"))
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl:1: not a JSON object"):
        read_rows(str(tmp_path / "broken.jsonl"), str(repos[0]))


def test_only_source_changes_are_graded():
    task = SweTask("i", "s", "/r", (), (), TEST_PATCH)
    assert task.graded("calc.py") and task.graded("pkg/core.py")
    for path in ("test_new.py", "tests/test_calc.py", "pkg/tests/helpers.py", "test_x.py", "x_test.py", "conftest.py",
                 "pkg/conftest.py", "sitecustomize.py", "usercustomize.py", "evil.pth", ".git/config"):
        assert not task.graded(path), path


def play(env, commands: list[str]) -> tuple[float, str]:
    env.reset(options={"row": 0})
    for command in commands:
        env.step(f"```bash\n{command}\n```")
    obs, reward, terminated, *_ = env.step("```bash\nsubmit\n```")
    assert terminated
    return reward, obs[0]["content"]


def pytest_site(folder) -> str:
    """pytest and what it imports, copied from this test's Python into a folder the sandbox can bind."""
    import importlib

    site = folder / "site"
    site.mkdir()
    for name in ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py"):
        path = importlib.import_module(name).__file__
        if os.path.basename(path) == "__init__.py":
            shutil.copytree(os.path.dirname(path), site / name)
        else:  # a module of one file (py.py)
            shutil.copy(path, site)
    return str(site)


def test_a_row_is_played_and_graded_as_swe_bench_grades(repos, tmp_path):
    folder, head = repos
    rows = write_rows(tmp_path / "rows.jsonl", [row(base_commit=head)])
    site = pytest_site(folder.parent)
    env = make_env("code", tasks=rows, repos=str(folder), ro_binds=(site,), python=f"PYTHONPATH={site} python3",
                   grade_s=60.0, sandbox_root=str(folder.parent))
    obs, _ = env.reset(options={"row": 0})
    assert "add() subtracts." in obs[0]["content"]
    assert env.eval_tasks(env.eval_seed, 64) == []  # one row: nothing to hold out
    fixed = "sed -i 's/a - b/a + b/' calc.py"
    cheat = "echo 'def test_add(): pass' > tests/test_calc.py; echo 'import sys; sys.exit(0)' > conftest.py"
    assert play(env, [])[0] == 0.0
    reward, text = play(env, [cheat])
    assert reward == 0.0 and "do not pass" in text
    reward, text = play(env, [fixed, cheat])
    assert reward == 1.0, text
    assert play(env, [fixed, "rm calc.py"])[0] == 0.0  # a deleted source file is a change too
    env.close()
