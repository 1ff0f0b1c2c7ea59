"""Real task sets for `--env code`: SWE-bench / SWE-Gym rows on local files, graded as SWE-bench.

What a user prepares (step by step in docs/sandbox.md):
- rows: a JSONL or Parquet file with SWE-bench's fields: `instance_id`, `problem_statement`,
  `FAIL_TO_PASS` and `PASS_TO_PASS` (lists, or JSON text of lists as SWE-bench stores them),
  `test_patch` and `base_commit` (optional, recommended), anything else ignored;
- repos: a folder holding, for each row, `<instance_id>/`, the repository checked out at
  `base_commit` (if it is a git checkout, its HEAD is checked against `base_commit`);
- the environment the tests need: an exported root filesystem (`--code.rootfs`: python,
  pytest, the repository's dependencies, git), or host folders bound read-only
  (`--code.ro-binds`) with `--code.python` naming the interpreter.

Grading: a fresh folder holds the pristine repository; the agent's changed and deleted files
are applied except tests (files `test_patch` touches, anything under a `test`/`tests`/`testing`
folder, `test_*.py`, `*_test.py`, `conftest.py`) and interpreter hooks (`sitecustomize.py`,
`usercustomize.py`, `*.pth`) and `.git`; then `test_patch` is applied with `git apply` and
FAIL_TO_PASS + PASS_TO_PASS run with pytest in a fresh sandbox. Reward 1.0 when pytest reports
every one of them PASSED (parsed from `-rA`, as SWE-bench parses its logs).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from envs.rows import read_table
from envs.sandbox import WORKDIR, Episode, Limits, Sandbox

REQUIRED = ("instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS")
HOOKS = ("sitecustomize.py", "usercustomize.py", "conftest.py")
_PATCHED = re.compile(r"^diff --git a/(\S+) b/(\S+)", re.MULTILINE)
_PASSED = re.compile(r"^PASSED (\S+)", re.MULTILINE)


@dataclass(frozen=True)
class SweTask:
    """One row: the issue, the prepared repository and the tests that decide it."""

    instance_id: str
    statement: str
    repo: str
    """The prepared checkout (repos/<instance_id>)."""
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_patch: str = ""
    base_commit: str = ""

    def key(self) -> str:
        return self.instance_id

    def prompt(self) -> str:
        return (f"Resolve this issue in the repository at {WORKDIR}:\n{self.statement.strip()}\n"
                "Hidden tests decide; changes to tests are not graded.")

    @functools.cached_property
    def protected(self) -> frozenset[str]:
        """Paths the agent's changes never reach: the files `test_patch` touches."""
        return frozenset(p for pair in _PATCHED.findall(self.test_patch) for p in pair)

    def graded(self, relpath: str) -> bool:
        """Whether a change of the agent's to `relpath` is applied before grading."""
        parts = relpath.split("/")
        name = parts[-1]
        return not (relpath in self.protected or parts[0] == ".git" or name in HOOKS or name.endswith(".pth")
                    or any(p in ("test", "tests", "testing") for p in parts[:-1])
                    or (name.startswith("test_") and name.endswith(".py")) or name.endswith("_test.py"))


def _ids(value, field: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{where}: {field} must be a list of test ids or its JSON text, got {value[:80]!r}") \
                from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {field} must be a list of test ids, got {type(value).__name__}")
    return tuple(value)


@functools.lru_cache(maxsize=8)
def read_rows(path: str, repos: str) -> tuple[SweTask, ...]:
    """The rows of a JSONL or Parquet file as tasks over the checkouts in `repos` (cached per
    process); ValueError naming the row and what is wrong (a missing field or checkout, another commit)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--code.tasks {path!r}: no such file (a JSONL or Parquet file of SWE-bench rows)")
    if not repos or not os.path.isdir(repos):
        raise ValueError(f"--code.repos {repos!r}: no such folder (one checkout per row, named by instance_id)")
    try:
        rows = read_table(file)
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    tasks = []
    for n, row in enumerate(rows, 1):
        where = f"{path}: row {n}"
        missing = [f for f in REQUIRED if not isinstance(row, dict) or f not in row]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)} (SWE-bench rows carry {', '.join(REQUIRED)})")
        instance = str(row["instance_id"])
        repo = os.path.join(repos, instance)
        if "/" in instance or not os.path.isdir(repo):
            raise ValueError(f"{where}: no checkout {repo!r} for instance {instance!r}")
        commit = str(row.get("base_commit") or "")
        head = _git_head(repo)
        if commit and head and head != commit:
            raise ValueError(f"{where}: {repo} is at {head[:12]}, the row's base_commit is {commit[:12]}: "
                             f"run `git -C {repo} checkout {commit}`")
        tasks.append(SweTask(instance, str(row["problem_statement"]), repo,
                             _ids(row["FAIL_TO_PASS"], "FAIL_TO_PASS", where),
                             _ids(row["PASS_TO_PASS"], "PASS_TO_PASS", where),
                             str(row.get("test_patch") or ""), commit))
    if not tasks:
        raise ValueError(f"{path}: no rows")
    return tuple(tasks)


def _git_head(repo: str) -> str:
    """The commit a checkout's detached HEAD points at ("" if it is not one)."""
    try:
        head = Path(repo, ".git", "HEAD").read_text().strip()
    except OSError:
        return ""
    return head if re.fullmatch(r"[0-9a-f]{40}", head) else ""


def apply_changes(task: SweTask, agent: Episode, grading: Episode) -> int:
    """Copy the agent's graded changes (new, changed, deleted regular files) from its work folder
    onto the pristine copy in `grading`; how many."""
    pristine, mine = Path(task.repo), agent.folder
    changed = 0
    seen = set()
    for folder, dirs, files in os.walk(mine):  # os.walk does not follow links
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), mine)
            seen.add(rel)
            if not task.graded(rel):
                continue
            text = agent.read(rel, limit=8 << 20)
            if text is None:
                continue
            try:
                same = Path(pristine, rel).read_text() == text
            except (OSError, UnicodeDecodeError):
                same = False
            if not same:
                grading.write(rel, text)
                changed += 1
    for folder, _, files in os.walk(pristine):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), pristine)
            if rel not in seen and task.graded(rel):
                grading.path(rel).unlink(missing_ok=True)
                changed += 1
    return changed


def grade(task: SweTask, sandbox: Sandbox, agent: Episode, limits: Limits, python: str) -> tuple[bool, str]:
    """SWE-bench's verdict on the agent's work folder, and a short reason. `python` is the
    command that runs the environment's Python (the user's, not quoted: "PYTHONPATH=/x python3")."""
    tests = task.fail_to_pass + task.pass_to_pass
    with sandbox.episode() as grading, tempfile.TemporaryDirectory(prefix="tandem-grader-") as hidden:
        grading.copy_in(task.repo)
        apply_changes(task, agent, grading)
        Path(hidden, "test.patch").write_text(task.test_patch)
        os.chmod(hidden, 0o755)
        apply = "git apply --whitespace=nowarn /grader/test.patch && " if task.test_patch.strip() else ""
        command = f"{apply}{python} -m pytest -rA -p no:cacheprovider -q -- " + \
            " ".join(shlex.quote(t) for t in tests)
        result = grading.run(command, limits, binds=((hidden, "/grader"),))
    if result.killed:
        return False, f"the tests were killed ({result.killed})"
    passed = set(_PASSED.findall(result.output))
    failing = [t for t in tests if t not in passed]
    if failing:
        return False, f"{len(failing)} of {len(tests)} tests do not pass (first: {failing[0]})"
    return True, f"all {len(tests)} tests pass"
