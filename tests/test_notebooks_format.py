"""Every notebook is committed clean: no outputs, kernel python3, a tagged parameters cell of literals
that papermill parses, and text that matches the README and the package."""

from __future__ import annotations

import ast
import logging
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
    and the next code cell reads $NVRX_LAB_SMOKE when it is None."""
    nb = nbformat.read(path, as_version=4)
    i, params = _parameters(nb)
    smoke = [s for s in ast.parse(params.source).body if isinstance(s, ast.AnnAssign) and s.target.id == "smoke"]
    assert smoke and ast.literal_eval(smoke[0].value) is None, "parameters: `smoke: Optional[bool] = None  # …`"
    after = next(c for c in nb.cells[i + 1:] if c.cell_type == "code")
    assert "if smoke is None" in after.source and "NVRX_LAB_SMOKE" in after.source, \
        "the cell after the parameters resolves smoke from $NVRX_LAB_SMOKE"


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
