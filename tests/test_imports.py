"""Imports run one way (docs: DESIGN.md, "Imports run one way").

launch/ may import every part; actors/ imports replay/ (wire types), weights/, envs/
and the policy; learner/ imports replay/, weights/ and the policy; envs/, replay/ and
policy/ import no other part, and weights/ none but the policy's adapter format
(policy.adapter); actors/ and learner/ never import each other. No part imports bench/ or
tests/. Every import counts: at the top of a module or inside a function, relative
ones, and `importlib.import_module` / `__import__` of a name written in the code.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("actors", "learner", "replay", "weights", "envs", "policy", "launch")
ALLOWED = {
    "launch": set(PARTS),
    "actors": {"replay", "weights", "envs", "policy"},
    "learner": {"replay", "weights", "policy"},
    "envs": set(),
    "replay": set(),
    "weights": {"policy"},
    "policy": set(),
}
"""Which parts each part may import (its own package always)."""
ONLY = {("weights", "policy"): {"policy.adapter"}}
"""Where a part may import only some modules of another: weights/ takes the adapter format alone."""
PROJECT = set(PARTS) | {"bench", "tests"}


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at `path` under `root`."""
    package = path.relative_to(root).parts[:-1]  # a module's package, or an __init__.py's own
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package[: len(package) - (node.level - 1)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module
            out.append((node.lineno, name))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None)
                   in ("import_module", "__import__"))):
            out.append((node.lineno, node.args[0].value))
    return out


def test_the_scanner_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "actors"
    pkg.mkdir()
    module = pkg / "m.py"
    module.write_text("import learner.trainer\n"
                      "from . import rollout\n"
                      "def f():\n"
                      "    from replay.wire import Group\n"
                      "    import importlib\n"
                      "    importlib.import_module('launch.async')\n"
                      "    __import__('bench')\n")
    names = [name for _, name in imported_modules(module, tmp_path)]
    assert names == ["learner.trainer", "actors", "replay.wire", "importlib", "launch.async", "bench"]


def test_imports_run_one_way():
    wrong = []
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            for line, name in imported_modules(path):
                top = name.split(".")[0]
                if top in PROJECT and top != part and top not in ALLOWED[part]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
                elif (part, top) in ONLY and name not in ONLY[part, top]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} (only {sorted(ONLY[part, top])})")
    assert not wrong, "imports against DESIGN.md's one-way rule:\n" + "\n".join(wrong)


def test_every_part_is_checked():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"bench"} == set(PARTS), "a new package needs its row in ALLOWED"
