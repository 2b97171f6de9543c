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
import textwrap
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
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return f"[{', '.join(map(_fmt, v))}]"
    return str(v)


WIDTH = 100
"""Columns a table fits in: a wider one is printed in parts, each repeating the row's key columns."""


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _keys(rows: list[dict[str, Any]], columns: list[str]) -> int:
    """How many leading columns name a row: up to the last non-numeric one among the first three, at least one."""
    texts = [i for i, c in enumerate(columns[:3]) if any(c in r and not _numeric(r[c]) for r in rows)]
    return max(texts) + 1 if texts else 1


CELL = 48
"""A text cell longer than this is wrapped onto more lines of its row."""


def _lines(cells: list[list[list[str]]], columns: list[str], picked: list[int], keys: int) -> list[str]:
    """The table of the ``picked`` columns, with the rows that have a value in one of them beyond the keys."""
    cells = [row for row in cells if any(row[i] != [""] for i in picked[keys:])] or cells
    widths = {i: max(len(columns[i]), *(len(ln) for row in cells for ln in row[i])) for i in picked}
    left = {picked[0]} | {i for i in picked if any(len(row[i]) > 1 for row in cells)}  # the first, and wrapped text

    def line(vals: list[str]) -> str:
        return "  ".join(vals[i].ljust(widths[i]) if i in left else vals[i].rjust(widths[i]) for i in picked).rstrip()

    out = [line(columns), line(["-" * widths.get(i, 0) for i in range(len(columns))])]
    for row in cells:
        height = max(len(row[i]) for i in picked)
        out += [line([c[k] if k < len(c) else "" for c in row]) for k in range(height)]
    return out


def format_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None, width: int = WIDTH) -> str:
    """``rows`` as aligned text; ``columns`` picks and orders them (default: every row's keys).

    A column empty in every row is left out and a text longer than :data:`CELL` wraps within its cell; a table wider
    than ``width`` is printed in parts, one under the other, each starting with the key columns (the leading ones
    that name a row, as ``ranks protocol``) and holding the rows with a value in it."""
    if not rows:
        return "(no rows)"
    columns = [c for c in (columns or dict.fromkeys(k for r in rows for k in r)) if any(r.get(c, "") != "" for r in rows)]
    cells = [[textwrap.wrap(_fmt(r.get(c, "")), CELL) or [""] for c in columns] for r in rows]
    size = [max(len(c), *(len(ln) for row in cells for ln in row[i])) + 2 for i, c in enumerate(columns)]
    keys = list(range(min(_keys(rows, columns), len(columns))))
    parts, part = [], list(keys)
    for i in range(len(keys), len(columns)):
        if len(part) > len(keys) and sum(size[j] for j in part) + size[i] - 2 > width:
            parts.append(part)
            part = list(keys)
        part.append(i)
    parts.append(part)
    return "\n\n".join("\n".join(_lines(cells, columns, p, len(keys))) for p in parts)


def report(name: str, rows: list[dict[str, Any]], out: str | Path, command: str, extra: dict | None = None,
           columns: Sequence[str] | None = None) -> dict:
    """Print the table and write ``out`` (JSON: command, machine, rows, extra, and the columns the table shows)."""
    result = {"benchmark": name, "command": command, "machine": machine(), "rows": rows, **(extra or {}),
              "columns": list(columns or dict.fromkeys(k for r in rows for k in r))}
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
