"""The package's imports run one way: no cycle, and no import from a lower layer to a higher one.

The layers are written once, here, top to bottom; docs/architecture.md states the same list (tests/test_doc_pages.py
holds the two equal). A unit is a top-level module or package of `xgblora`; modules inside one package may import each
other (the cycle check still covers them), units of one layer may not import each other. Function-local imports count
like any other: a local import does not get round a cycle or a layer.
"""

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "xgblora"

LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("demo",),
    ("compare", "env", "bench"),
    ("recipes",),
    ("generation",),
    ("export",),
    ("train",),
    ("evaluation", "preference"),
    ("embeddings",),
    ("optim",),
    ("adapters",),
    ("models", "distributed"),
    ("data",),
    ("parsing",),
    ("trl_names",),
    ("config", "report"),
    ("options",),
    ("logs", "trackers", "checkpoint", "perf"),
    ("atomic", "usercode", "outputs"),
    ("errors",),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Module -> the xgblora modules it imports (at any depth of its code)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _targets(node, name, path.name == "__init__.py"):
                if target.startswith("xgblora"):
                    module = target if target in modules else target.rsplit(".", 1)[0]
                    graph[name].update(set(_with_parents(module)) - set(_with_parents(name)))
    return dict(graph)


def _with_parents(module: str) -> list[str]:
    """a.b.c with the packages whose __init__ importing it runs (a.b), for an importer outside them; the packages
    around the importer itself are already initialised when it runs."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


def _targets(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolve against the importing package
        package = importer.split(".")[: len(importer.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def unit(module: str) -> str:
    """The top-level module or package a module belongs to ('xgblora.train.loop' -> 'train')."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(name: str) -> int:
    for depth, names in enumerate(LAYERS):
        if name in names:
            return depth
    raise AssertionError(f"xgblora.{name} is in no layer: add it to LAYERS here and to docs/architecture.md")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that returns to its start, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import that points from a unit to a unit of its own or a higher layer."""
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            a, b = unit(source), unit(target)
            if a and b and a != b and layer_of(b) <= layer_of(a):
                wrong.append(f"{source} -> {target} (layer {layer_of(a)} -> {layer_of(b)})")
    return sorted(wrong)


def test_every_unit_has_a_layer():
    for module in import_graph():
        if unit(module):
            layer_of(unit(module))


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_imports_point_down():
    assert upward_imports(import_graph()) == []


def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    package = tmp_path / "xgblora"
    (package / "train").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train" / "__init__.py").write_text("")
    (package / "errors.py").write_text("from xgblora.train.loop import Trainer\n")
    (package / "train" / "loop.py").write_text("def f():\n    from xgblora import errors\n")
    graph = import_graph(package)
    assert find_cycle(graph) == ["xgblora.errors", "xgblora.train.loop", "xgblora.errors"]
    errors, train = LAYERS.index(("errors",)), LAYERS.index(("train",))
    assert upward_imports(graph) == [f"xgblora.errors -> xgblora.train (layer {errors} -> {train})",
                                     f"xgblora.errors -> xgblora.train.loop (layer {errors} -> {train})"]
