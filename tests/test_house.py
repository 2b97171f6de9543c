"""The house rules a newcomer relies on: ruff passes, small modules and functions, no import cycle, and
the layers (checkpoint, inprocess, launcher, eks) never import one another."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nvrx_lab"
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60
LAYERS = ("checkpoint", "inprocess", "launcher", "eks")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every nvrx_lab module ``name`` imports, at any depth of its code (typing-only imports aside)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_layers_do_not_import_one_another():
    wrong = [f"{name} imports {dep}" for name, deps in graph().items() for dep in deps
             for mine in LAYERS for other in LAYERS
             if mine != other and name.startswith(f"nvrx_lab.{mine}") and dep.startswith(f"nvrx_lab.{other}")]
    assert not wrong, wrong


def test_modules_and_functions_are_small():
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if (lines := text.count("\n")) > MAX_MODULE_LINES:
            too_big.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    too_big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines "
                                   f"(at most {MAX_FUNCTION_LINES})")
    assert not too_big, "\n".join(too_big)


def test_ruff_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.fail("ruff is missing from this environment: pip install -e '.[test]'")
    res = subprocess.run([ruff, "check", "nvrx_lab", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
