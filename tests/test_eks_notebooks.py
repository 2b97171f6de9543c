"""Notebook 06 injects no faults by default, checks every parameter's type and range (nvrx_lab.workbook), and its
fault schedule, namespace and FSx values against the job it submits, before anything is rendered (the parameters
cells themselves are checked for every notebook in test_notebooks_format.py)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from nvrx_lab.workbook import ParameterError

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _code(name: str) -> list[nbformat.NotebookNode]:
    return [c for c in nbformat.read(NOTEBOOKS / name, as_version=4).cells if c.cell_type == "code"]


def _run_06_until_spec(**params) -> dict:
    """Execute notebook 06 up to the cell that builds the JobSpec (the one after the parameters' check cell), with
    papermill-style overrides."""
    code = _code("06_submit_p5_job.ipynb")
    i = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", []))
    ns: dict = {}
    for cell in code[:i + 1]:
        exec(cell.source, ns)  # noqa: S102 - the notebook's own cells
    ns.update(params)
    for cell in code[i + 1:i + 3]:  # the check cell, then the spec
        exec(cell.source, ns)  # noqa: S102
    return ns


def test_notebook_06_defaults_make_a_valid_spec_without_faults():
    ns = _run_06_until_spec()
    assert ns["spec"].faults == ns["faults"] == "" and ns["spec"].nodes == ns["nodes"]  # a real job: no injected faults
    assert ns["spec"].namespace == "nvrx-lab" and ns["spec"].fsx_volume_handle == ""


def test_notebook_06_takes_namespace_fsx_and_queue():
    fsx = dict(fsx_id="fs-0123456789abcdef0", fsx_dns="fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com",
               fsx_mount_name="abcdefgh")
    spec = _run_06_until_spec(namespace="team-a", queue_name="p5", **fsx)["spec"]
    assert spec.namespace == "team-a" and spec.queue_name == "p5" and spec.fsx_volume_handle == fsx["fsx_id"]
    with pytest.raises(ValueError, match="JobSpec.fsx_mount_name: required when fsx_volume_handle is set"):
        _run_06_until_spec(fsx_id=fsx["fsx_id"], fsx_dns=fsx["fsx_dns"])
    with pytest.raises(ValueError, match="JobSpec.namespace: 'Team_A'"):
        _run_06_until_spec(namespace="Team_A")


@pytest.mark.parametrize("params, message", [
    (dict(nodes="two"), "parameter nodes: expected an integer in [1, 512], got 'two' (str)"),
    (dict(nodes=0), "parameter nodes: must be in [1, 512], got 0"),
    (dict(dry_run="False"), "parameter dry_run: expected True or False, got 'False' (str)"),
    (dict(replace=1), "parameter replace: expected True or False, got 1 (int)"),
    (dict(mode="ft-launcher"), "parameter mode: 'ft-launcher' is not one of"),
    (dict(steps=2.5), "parameter steps: expected an integer >= 1, got 2.5 (float)"),
    (dict(faults=None), "parameter faults: None is not a value here"),
    (dict(cluster=""), "parameter cluster: must not be empty"),
    (dict(fsx_id=7), "parameter fsx_id: expected a string, got 7 (int)"),
    (dict(local_steps=1), "parameter local_steps: must be in [2, 1000], got 1"),
])
def test_notebook_06_type_checks_every_parameter(params, message):
    with pytest.raises(ParameterError) as err:
        _run_06_until_spec(**params)
    assert message in str(err.value)


@pytest.mark.parametrize("params, message", [
    (dict(nodes=1, faults="11:600:sigkill"), "JobSpec.faults: '11:600:sigkill': rank 11 does not exist; allowed: ranks 0..7"),
    (dict(steps=500, faults="11:600:sigkill"), "JobSpec.faults: '11:600:sigkill': step 600 never runs; allowed: steps 1..500"),
    (dict(faults="3:10:exception:save"), None),
    (dict(faults="3:10:exception:later"), "phase 'later' is not one of step, save, load"),
])
def test_notebook_06_checks_its_fault_schedule_against_the_job(params, message):
    if message is None:
        assert _run_06_until_spec(**params)["spec"].faults == params["faults"]
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _run_06_until_spec(**params)
