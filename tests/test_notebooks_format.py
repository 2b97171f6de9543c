"""Every notebook is committed clean: no outputs, kernel python3, a tagged parameters cell of literals."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
SMOKE_LINE = 'os.environ.get("NVRX_LAB_SMOKE", "1") != "0"'


def test_there_are_notebooks():
    assert any(nb.name.startswith("00_") for nb in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean_and_parameterised(path):
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"code cells {dirty} carry outputs: clear them before committing"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "exactly one code cell must be tagged 'parameters'"
    names = set()
    for stmt in ast.parse(params[0].source).body:
        assert isinstance(stmt, ast.AnnAssign), f"parameters: {ast.unparse(stmt)!r} is not `name: type = literal`"
        names.add(stmt.target.id)
        value = ast.unparse(stmt.value)
        if stmt.target.id == "smoke":
            assert value == ast.unparse(ast.parse(SMOKE_LINE).body[0].value)
        else:
            ast.literal_eval(stmt.value)  # raises on anything but a literal
    assert "smoke" in names
    commented = [line for line in params[0].source.splitlines() if line.strip()]
    assert all("#" in line for line in commented), "every parameter carries a comment (papermill --help-notebook)"
