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


# -- issue #34: a house a newcomer can change without reading all of it ------------------------------------
MAX_TOP_LEVEL_MODULES = 12
MAX_SLEEP_POLLS = 3
MAX_MANY_PARAMETER_FUNCTIONS = 3
MAX_ENV_READERS = 9  # 8, and net.py: $NVRX_LAB_PORTS, the slice of ports a process (and every child) picks from


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_a_top_level_of_few_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules (at most {MAX_TOP_LEVEL_MODULES}): {top}"


def test_waits_go_through_the_one_wait_helper():
    """A loop that sleeps to poll is a wait: ``nvrx_lab.net.wait_for`` (bounded, it beats nvrx_lab.liveness where
    asked, one place to read). What may keep its own loop is counted here, and says why in a comment."""
    polls = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.While) and any(isinstance(n, ast.Call) and ast.unparse(n.func) == "time.sleep"
                                                   for n in ast.walk(node)):
                polls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    allowed = {"nvrx_lab/net.py"}  # the helper itself
    outside = [p for p in polls if p.split(":")[0] not in allowed]
    assert len(outside) <= MAX_SLEEP_POLLS, f"{len(outside)} sleep-poll loops outside wait_for: {outside}"


def test_functions_take_few_parameters():
    many = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                if names and names[0] in ("self", "cls"):
                    names = names[1:]
                if len(names) > 8:
                    many.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({len(names)})")
    assert len(many) <= MAX_MANY_PARAMETER_FUNCTIONS, f"{len(many)} functions over 8 parameters: {many}"


def test_the_environment_is_read_where_a_process_starts():
    readers = sorted(str(p.relative_to(ROOT)) for p, _ in _trees()
                     if "os.environ" in p.read_text() or "getenv" in p.read_text())
    assert len(readers) <= MAX_ENV_READERS, f"{len(readers)} modules read the environment: {readers}"


def test_no_forwarding_between_our_own_components():
    """Contracts a reader can find: no ``__getattr__`` forwarding anywhere in the package."""
    forwards = [f"{p.relative_to(ROOT)}:{n.lineno}" for p, tree in _trees() for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    assert not forwards, forwards


def test_one_fault_vocabulary():
    """Every demo worker and the trainer inject through nvrx_lab.faults; nobody declares kinds of its own."""
    own = [f"{p.relative_to(ROOT)}:{n.lineno}" for p, tree in _trees() for n in ast.walk(tree)
           if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "KINDS" for t in n.targets)
           and p.parent.name != "faults" and "bench" not in p.parts and p.name != "recovery_worker.py"]
    assert not own, f"fault kinds declared outside nvrx_lab.faults: {own}"
    injectors = [str(p.relative_to(ROOT)) for p, tree in _trees() for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and n.name == "inject" and p.parent.name != "faults"]
    assert not injectors, f"fault injectors outside nvrx_lab.faults: {injectors}"
