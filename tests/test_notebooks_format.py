"""Every notebook is committed clean: no outputs, kernel python3, a tagged parameters cell of literals
that papermill parses, and text that matches the README and the package."""

from __future__ import annotations

import ast
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from papermill.translators import PythonTranslator

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _read(name_prefix: str) -> nbformat.NotebookNode:
    (path,) = [p for p in NOTEBOOKS if p.name.startswith(name_prefix)]
    return nbformat.read(path, as_version=4)


def _parameters(nb) -> tuple[int, nbformat.NotebookNode]:
    tagged = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one code cell must be tagged 'parameters'"
    return tagged[0]


def test_there_are_notebooks():
    assert any(nb.name.startswith("00_") for nb in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"code cells {dirty} carry outputs: clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_parameters_are_literals(path):
    """`name: type = literal  # help` only, so papermill can list and override every parameter; whatever
    is derived (smoke from the environment, sizes from smoke) is derived in a later cell."""
    _, params = _parameters(nbformat.read(path, as_version=4))
    for stmt in ast.parse(params.source).body:
        assert isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None, \
            f"parameters: {ast.unparse(stmt)!r} is not `name: type = literal`"
        try:
            ast.literal_eval(stmt.value)
        except ValueError:
            pytest.fail(f"parameters: {stmt.target.id} = {ast.unparse(stmt.value)} is not a literal: "
                        "put a literal here (e.g. None) and derive the value in the next cell")
    commented = [line for line in params.source.splitlines() if line.strip()]
    assert all("#" in line for line in commented), "every parameter carries a comment (papermill --help-notebook)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_papermill_parses_every_parameter(path, caplog):
    """What `papermill --help-notebook` lists: every parameter, with no "Unable to parse line" warning
    (an `=` in a comment, an annotation such as `bool | None` that its pattern does not read)."""
    _, params = _parameters(nbformat.read(path, as_version=4))
    declared = [s.target.id for s in ast.parse(params.source).body if isinstance(s, ast.AnnAssign)]
    with caplog.at_level(logging.WARNING):
        parsed = PythonTranslator.inspect(params)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [p.name for p in parsed] == declared


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_smoke_switch_resolved_after_the_parameters(path):
    """`smoke` defaults to None in the parameters cell (papermill `-p smoke False` still overrides it),
    and the next code cell resolves it with `Parameters(smoke)`, which reads $NVRX_LAB_SMOKE when it is None."""
    nb = nbformat.read(path, as_version=4)
    i, params = _parameters(nb)
    smoke = [s for s in ast.parse(params.source).body if isinstance(s, ast.AnnAssign) and s.target.id == "smoke"]
    assert smoke and ast.literal_eval(smoke[0].value) is None, "parameters: `smoke: Optional[bool] = None  # …`"
    check = ast.unparse(ast.parse(_check_cell(nb, i).source))
    assert "p = Parameters(smoke)" in check and "smoke = p.smoke" in check, \
        "the cell after the parameters resolves smoke: `p = Parameters(smoke)`, then `smoke = p.smoke`"


def _check_cell(nb, i: int) -> nbformat.NotebookNode:
    return next(c for c in nb.cells[i + 1:] if c.cell_type == "code")


def _declared(params) -> list[str]:
    return [s.target.id for s in ast.parse(params.source).body if isinstance(s, ast.AnnAssign)]


def _checked(stmt: ast.stmt) -> str | None:
    """``NAME`` when ``stmt`` is ``NAME = p.KIND("NAME", NAME, …)`` (or ``smoke = p.smoke``), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    name, value = stmt.targets[0].id, stmt.value
    if name == "smoke":
        return name if ast.unparse(value) == "p.smoke" else None
    call = isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and ast.unparse(value.func.value) == "p"
    args = value.args if call else []
    ok = len(args) >= 2 and isinstance(args[0], ast.Constant) and args[0].value == name and ast.unparse(args[1]) == name
    return name if ok else None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_parameter_checked_in_the_next_cell(path):
    """The cell after the parameters checks each parameter once, `NAME = p.KIND("NAME", NAME, …)` (type and range,
    a one-line `ParameterError` each), and ends with `p.done()`: nothing runs before every value is known good."""
    nb = nbformat.read(path, as_version=4)
    i, params = _parameters(nb)
    body = ast.parse(_check_cell(nb, i).source).body
    checked = [name for name in map(_checked, body) if name]
    assert sorted(checked) == sorted(_declared(params)), \
        f"check each parameter once after the parameters cell: declared {_declared(params)}, checked {checked}"
    assert ast.unparse(body[-1]) == "p.done()", "the check cell ends with `p.done()` (one line: every value)"
    calls = [ast.unparse(s) for s in body[:-1] if isinstance(s, ast.Expr)]
    assert not calls, f"the check cell only checks; it runs nothing: {calls}"


def _bound(tree: ast.AST) -> list[tuple[str, int]]:
    """The names a cell binds at the notebook's top level (not inside functions, lambdas, classes or
    comprehensions, which have scopes of their own), with their line."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.name, node.lineno))
            for deco in node.decorator_list:
                visit(deco)
            return
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.append((node.id, node.lineno))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.extend(((a.asname or a.name).split(".")[0], node.lineno) for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.append((node.name, node.lineno))
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out.extend((n, node.lineno) for n in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_cell_overrides_a_parameter(path):
    """After the parameters cell a parameter is bound once, by its check: no `steps = 12 if smoke else steps`,
    no `if smoke: steps = …`, no loop variable or import of the same name, so smoke mode never silently
    replaces a value the user set (a smoke-dependent size is `None` and its check picks the default)."""
    nb = nbformat.read(path, as_version=4)
    i, params = _parameters(nb)
    declared = set(_declared(params))
    check = _check_cell(nb, i)
    overrides = []
    for n, cell in enumerate(nb.cells[i + 1:], start=i + 1):
        if cell.cell_type != "code":
            continue
        tree = ast.parse(cell.source)
        if cell is check:  # its own `NAME = p.KIND("NAME", NAME, …)` lines are the one binding allowed
            tree.body = [s for s in tree.body if not _checked(s)]
        overrides += [f"cell {n} line {line}: {name}" for name, line in _bound(tree) if name in declared]
    assert not overrides, f"parameters re-bound after their check (let the check's default do it): {overrides}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_name_is_defined(path):
    """Every name a cell uses is defined by an earlier cell or imported (ruff's F821 over the notebook): the
    check cell replaced `import os`, and a cell that still used it would fail only when run."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.fail("ruff is missing from this environment: pip install -e '.[test]'")
    res = subprocess.run([ruff, "check", "--isolated", "--no-cache", "--select", "F821", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_is_the_readmes(path):
    """The README sets up with `make` (`make lab`, `make workbook`); no notebook says `pip install -e .`."""
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "pip install -e ." not in text, "say `make lab` (or `make workbook`), as the README does"


def test_goodput_study_never_calls_the_fault_free_run_baseline():
    """`baseline` is the Kubernetes pod-restart mode. The benchmark's own per-run reports title its
    fault-free run `--- baseline` too, so 04 shows the runs under the JSON's mode names (the first one
    is "fault-free") instead of printing the benchmark's output."""
    nb = _read("04_")
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "print(result.output" not in code
    assert '"fault-free"' in code
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "fault-free" in markdown and "launch" in markdown and "first event to its last" in markdown, \
        "04 says which wall time each goodput figure divides by"
