"""A notebook's conclusion is held to its run's figures: flip one figure and the notebook fails at its conclusion,
naming the claim the flipped figure contradicts and no other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from nvrx_lab.workbook.claims import ClaimError, conclude

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_conclude_prints_every_claim_and_fails_on_the_contradicted_ones(capsys):
    assert conclude(("two is more than one", 2 > 1)) == ["two is more than one"]
    with pytest.raises(ClaimError, match=r"1 of 2 claim\(s\) contradicted by this run's figures: one is more than two$"):
        conclude(("two is more than one", 2 > 1), ("one is more than two", 1 > 2), intro="Here:")
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == ["Here:", "  ✓ two is more than one", "  ✗ one is more than two"]
    with pytest.raises(TypeError, match="claim 0: expected a \\(sentence, holds\\) pair"):
        conclude("a sentence without its check")


def flipped(notebook: str, flip: str, tmp_path: Path) -> Path:
    """``notebook`` with a cell running ``flip`` just before its conclusion (the cell tagged ``conclusion``)."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    (at,) = [i for i, c in enumerate(nb.cells) if "conclusion" in c.metadata.get("tags", [])]
    nb.cells.insert(at, nbformat.v4.new_code_cell(flip, metadata={"tags": ["flip"]}))
    path = tmp_path / "notebooks" / notebook  # what it writes to ../build lands in tmp_path, not beside nbval's run
    path.parent.mkdir()
    nbformat.write(nb, path)
    return path


@pytest.mark.timeout(240)
def test_notebook_07_fails_when_a_figure_contradicts_its_conclusion(tmp_path):
    """The new protocol's cost per rank made to grow with N: the flat-in-N claim, and only it, fails the run."""
    path = flipped("07_scale.ipynb", 'new = [dict(r, ops_per_rank=r["ops_per_rank"] * r["ranks"]) for r in new]', tmp_path)
    out = tmp_path / "out.ipynb"
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.workbook.papermill", str(path), str(out), "-k", "python3",
                          "--cwd", str(path.parent), "--no-progress-bar", "--log-level", "WARNING",
                          "-y", "{ranks: [8, 32], legacy_max_ranks: 32, replica_groups: 2}"],
                         capture_output=True, text=True, timeout=200, env={**os.environ, "NVRX_LAB_SMOKE": "1"})
    assert res.returncode != 0, "the notebook ran to its end with a contradicted conclusion"
    code = [c for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"]
    errors = [(i, o.ename, o.evalue) for i, c in enumerate(code) for o in c.outputs if o.output_type == "error"]
    (at,) = [i for i, c in enumerate(code) if "conclusion" in c.metadata.get("tags", [])]
    assert [(i, name) for i, name, _ in errors] == [(at, "ClaimError")], errors  # every cell before it ran clean
    why = errors[0][2]
    assert why.startswith("1 of 6 claim(s) contradicted") and "flat in N" in why, why
    printed = "".join(o.get("text", "") for o in code[at].outputs)
    assert printed.count("✗") == 1 and printed.count("✓") == 5, printed
