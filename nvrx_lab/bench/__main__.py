"""``python -m nvrx_lab.bench NAME [flags]``: dispatch to ``nvrx_lab.bench.NAME.main``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import nvrx_lab.bench as bench_pkg


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print(f"usage: python -m nvrx_lab.bench {{{','.join(names)}}} [flags]", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown benchmark {argv[0]!r}; choose one of {', '.join(names)}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(f"nvrx_lab.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
