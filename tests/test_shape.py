"""The house's size rules: no function over 60 lines, no dataclass with over 30 fields of its own (an options group
or a command class that grows past that is two jobs)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "xgblora"
MAX_FUNCTION_LINES, MAX_OWN_FIELDS = 60, 30


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "dataclass")
               or (isinstance(d, ast.Call) and getattr(d.func, "id", None) == "dataclass") for d in node.decorator_list)


def _nodes():
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            yield path.relative_to(SRC), node


def test_no_function_is_longer_than_60_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)" for path, node in _nodes()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_dataclass_has_more_than_30_fields_of_its_own():
    big = [f"{path}:{node.lineno} {node.name}" for path, node in _nodes()
           if isinstance(node, ast.ClassDef) and _is_dataclass(node)
           and sum(isinstance(item, ast.AnnAssign) for item in node.body) > MAX_OWN_FIELDS]
    assert not big, big
