"""Notebook 06 checks its fault schedule against the job it submits, before anything is rendered (the
parameters cells themselves are checked for every notebook in test_notebooks_format.py)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _code(name: str) -> list[nbformat.NotebookNode]:
    return [c for c in nbformat.read(NOTEBOOKS / name, as_version=4).cells if c.cell_type == "code"]


def _run_06_until_spec(**params) -> dict:
    """Execute notebook 06 up to the cell that builds the JobSpec, with papermill-style overrides."""
    code = _code("06_submit_p5_job.ipynb")
    i = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", []))
    ns: dict = {}
    for cell in code[:i + 1]:
        exec(cell.source, ns)  # noqa: S102 - the notebook's own cells
    ns.update(params)
    exec(code[i + 1].source, ns)  # noqa: S102
    return ns


def test_notebook_06_defaults_make_a_valid_spec():
    ns = _run_06_until_spec()
    assert ns["spec"].faults == ns["faults"] and ns["spec"].nodes == ns["nodes"]


@pytest.mark.parametrize("params, message", [
    (dict(nodes=1), "JobSpec.faults: '11:600:sigkill': rank 11 does not exist; allowed: ranks 0..7"),
    (dict(steps=500), "JobSpec.faults: '11:600:sigkill': step 600 never runs; allowed: steps 1..500"),
    (dict(faults="3:10:exception:save"), None),
    (dict(faults="3:10:exception:later"), "phase 'later' is not one of step, save, load"),
])
def test_notebook_06_checks_its_fault_schedule_against_the_job(params, message):
    if message is None:
        assert _run_06_until_spec(**params)["spec"].faults == params["faults"]
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _run_06_until_spec(**params)
