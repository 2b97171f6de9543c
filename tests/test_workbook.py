"""`make workbook` runs every notebook even after a failure, names the failures and exits non-zero.

Two tiny notebooks in a temporary folder stand in for the workbook (``NOTEBOOKS=…``, ``BUILD=…``), so
this takes seconds and needs no torch. Make runs with the interpreter's own environment (``VENV``)
and ``-o STAMP``: it never sets the environment up again, also when ``.venv`` was made by ``make test``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from nvrx_lab.runner import RunResult, run

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)

pytestmark = [
    pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make"),
    pytest.mark.skipif(not (VENV / "bin" / "papermill").exists(), reason=f"no papermill in {VENV}"),
]


def _stamp() -> Path:
    """The Makefile's $(STAMP) for this environment (same command as the Makefile)."""
    cksum = subprocess.run("cat pyproject.toml | cksum | cut -d' ' -f1", shell=True, cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()
    return VENV / f".installed-{cksum}"


def _notebook(path: Path, source: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(nb, path)
    return path


def _make(*args: str, timeout: float = 150) -> RunResult:
    """``make -C ROOT -o STAMP ARGS VENV=…`` in its own process group (killed whole on timeout)."""
    # A parent make (`make test`) exports its flags and command-line variables; they are not ours.
    env = {k: "" for k in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES") if k in os.environ}
    res = run(["make", "--no-print-directory", "-C", str(ROOT), "-o", str(_stamp()), *args, f"VENV={VENV}"], timeout, env)
    assert not res.timed_out, res.output
    return res


def _workbook(*args: str, notebooks: list[Path]) -> RunResult:
    """``make workbook NOTEBOOKS=…``, once the dry run shows that it runs those notebooks, not the workbook's."""
    args = ("workbook", "NOTEBOOKS=" + " ".join(map(str, notebooks)), *args)
    dry = _make("-n", *args)
    assert all(str(nb) in dry.output for nb in notebooks), f"make workbook ignores NOTEBOOKS:\n{dry.output}"
    return _make(*args)


def test_workbook_runs_every_notebook_and_names_the_failures(tmp_path):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    failing = _notebook(nbs / "a_fails.ipynb", 'raise RuntimeError("boom")')
    passing = _notebook(nbs / "b_runs.ipynb", 'import os\nopen("ran.txt", "w").write(os.environ["NVRX_LAB_SMOKE"])')
    build = tmp_path / "build"
    p = _workbook(f"BUILD={build}", notebooks=[failing, passing])
    out = p.output
    assert p.returncode != 0, out
    assert "[setup" not in out, "the environment was set up again"
    assert (nbs / "ran.txt").read_text() == "1", f"the notebook after the failing one did not run (smoke on):\n{out}"
    assert {q.name for q in (build / "notebooks").iterdir()} == {"a_fails.ipynb", "b_runs.ipynb"}
    named = out[out.index("FAILED"):] if "FAILED" in out else ""
    assert str(failing) in named and str(passing) not in named, out
    assert (build / "report.md").exists(), "the report is written even when a notebook failed"


def test_workbook_exits_zero_when_every_notebook_runs(tmp_path):
    ok = _notebook(tmp_path / "ok.ipynb", "x = 1")
    p = _workbook(f"BUILD={tmp_path / 'build'}", notebooks=[ok])
    assert p.returncode == 0, p.output
    assert "FAILED" not in p.output and (tmp_path / "build" / "notebooks" / "ok.ipynb").exists()
