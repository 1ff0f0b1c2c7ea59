"""Imports run one way (docs: DESIGN.md, "Imports run one way").

launch/ may import every part; serve/ (the Tinker service) every part but launch/; actors/ imports replay/ (wire types), weights/, envs/
and the policy; learner/ imports replay/, weights/ and the policy; envs/, replay/ and
policy/ import no other part, and weights/ none but the policy's adapter format
(policy.adapter); actors/ and learner/ never import each other. No part imports bench/ or
tests/. Every import counts: at the top of a module or inside a function, relative
ones, and `importlib.import_module` / `__import__` of a name written in the code.
No two modules import each other, however indirectly: an import hidden inside a
function still ties the two modules together, so it counts for cycles as well.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("actors", "learner", "replay", "weights", "envs", "policy", "launch", "serve")
ALLOWED = {
    "launch": set(PARTS),
    "serve": set(PARTS) - {"launch"},
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


def imported_modules(path: Path, root: Path = ROOT, names: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at `path` under `root`; with
    `names`, also `module.name` for each name of a `from module import name` (which may be a
    submodule)."""
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
            if names:
                out += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
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


def module_graph(root: Path = ROOT, parts=PARTS) -> dict[str, set[str]]:
    """Each project module under `root` (dotted name) and the project modules it imports."""
    paths = {}
    for part in parts:
        for path in sorted((root / part).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            paths[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return {module: {name for _, name in imported_modules(path, root, names=True)
                     if name in paths and name != module}
            for module, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: each strongly connected set of two or more modules, as one
    path around it (Tarjan's algorithm, iterative so that deep chains cannot overflow)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return found


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path):
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "__init__.py").write_text("")
    (tmp_path / "actors" / "a.py").write_text("from actors.b import f\n")
    (tmp_path / "actors" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "actors" / "c.py").write_text("def g():\n    import actors.a\n")
    (tmp_path / "actors" / "d.py").write_text("import actors.a\n")
    graph = module_graph(tmp_path, parts=("actors",))
    assert graph["actors.b"] == {"actors", "actors.c"}
    assert cycles(graph) == [["actors.a", "actors.b", "actors.c"]]


def test_no_two_modules_import_each_other():
    found = cycles(module_graph())
    assert not found, "import cycles (function-local imports included):\n" + "\n".join(
        " <-> ".join(group) for group in found)
