"""Tables of results: a plain-text table on stdout and a JSON file with the same rows.

Every benchmark (``python -m nvrx_lab.bench …``) ends with :func:`report`; ``python -m
nvrx_lab.observe.report`` and the notebooks print rows with :func:`format_table`. :func:`median` and
:func:`p95` are the two statistics the tables show.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """Where a figure was measured: printed and stored with every result."""
    import torch

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def median(xs: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(xs) if xs else float("nan")


def p95(xs: Sequence[float]) -> float:
    """The 95th percentile (nearest rank), NaN for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.95 * (len(s) - 1))))]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """``rows`` as aligned text, one line per row; ``columns`` picks and orders them (default: the first row's keys)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths, strict=True)))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def report(name: str, rows: list[dict[str, Any]], out: str | Path, command: str, extra: dict | None = None,
           columns: Sequence[str] | None = None) -> dict:
    """Print the table and write ``out`` (JSON: command, machine, rows, extra)."""
    result = {"benchmark": name, "command": command, "machine": machine(), "rows": rows, **(extra or {})}
    print(format_table(rows, columns))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {out}")
    return result


def exit_status(failed: Sequence[str]) -> int:
    """A benchmark's exit code: 1 when a row failed (each printed its output already), named on stderr."""
    if failed:
        print(f"{len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
