"""``python -m nvrx_lab.bench NAME [flags]``: dispatch to ``nvrx_lab.bench.NAME.main``.

A missing or unknown NAME is one ``error:`` line (exit 2); ``--help`` lists the names, and
``python -m nvrx_lab.bench NAME --help`` a benchmark's flags.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import nvrx_lab.bench as bench_pkg

PROG = "python -m nvrx_lab.bench"


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} {{{','.join(names)}}} [flags]\n\nRun `{PROG} NAME --help` for a benchmark's flags.")
        return 0
    if not argv or argv[0] not in names:
        what = f"unknown benchmark {argv[0]!r}" if argv else "no benchmark given"
        print(f"error: {what}; choose one of {', '.join(names)} (see {PROG} --help)", file=sys.stderr)
        return 2
    module = importlib.import_module(f"nvrx_lab.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
