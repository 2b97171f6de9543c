"""The notebooks under nbval (``make test``): a cell's deadline is nbval's ``--nbval-cell-timeout``.

pytest-timeout's suite-wide ``timeout`` (pyproject.toml, for the tests) would otherwise end a notebook cell
first, with a stack dump of pytest's own threads instead of the cell's output: the Makefile's cell timeout is
the one a reader sets, so a cell gets that plus a margin for nbval to stop the kernel and report.
"""

import pytest

MARGIN_S = 30


def pytest_collection_modifyitems(config, items):
    cell_s = config.getoption("nbval_cell_timeout", default=None)
    if not cell_s:
        return
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.timeout(float(cell_s) + MARGIN_S))
