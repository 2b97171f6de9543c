"""The workbook report: ``python -m nvrx_lab.observe.report --build build`` → ``build/report.md`` and ``.html``.

It only *reads* what the notebooks and benchmarks wrote under ``build/``: the executed notebooks
and every benchmark JSON (``build/bench/*.json``, each with its rows, the command that produced
it and the machine it ran on) and the plots they list.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nvrx_lab.observe.table import format_table


def bench_section(path: Path) -> str:
    result = json.loads(path.read_text())
    m = result.get("machine", {})
    where = (f"{m.get('host', '?')}: {m.get('cpus', '?')} CPUs, torch {m.get('torch', '?')}, "
             f"GPU {m.get('cuda') or 'none'}, {m.get('when', '?')}")
    parts = [f"## {result.get('benchmark', path.stem)}", "", f"Command: `{result.get('command', '?')}`  ",
             f"Machine: {where}", "", "```", format_table(result.get("rows", []), result.get("columns")), "```", ""]
    for note in result.get("notes", []):
        parts.append(f"- {note}")
    for plot in result.get("plots", []):
        parts.append(f"![{Path(plot).stem}]({plot})")
    return "\n".join(parts) + "\n"


def build_report(build: Path) -> str:
    lines = ["# nvrx_lab workbook report", ""]
    notebooks = sorted((build / "notebooks").glob("*.ipynb"))
    lines += ["## Executed notebooks", ""] + [f"- [{nb.name}](notebooks/{nb.name})" for nb in notebooks] + [""]
    if not notebooks:
        lines.append("(none yet: run `make workbook`)\n")
    benches = sorted((build / "bench").glob("*.json"))
    lines += [bench_section(p) for p in benches]
    if not benches:
        lines.append("No benchmark results under build/bench/ yet: run `python -m nvrx_lab.bench NAME`.\n")
    return "\n".join(lines)


def to_html(markdown_text: str) -> str:
    import mistune  # ships with nbconvert, which jupyterlab and papermill install

    body = mistune.html(markdown_text)
    return ("<!doctype html><meta charset='utf-8'><title>nvrx_lab report</title>"
            f"<body style='font-family:sans-serif;max-width:60em'>{body}</body>")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvrx_lab.observe.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build", help="the build folder the workbook wrote (default: build)")
    args = parser.parse_args(argv)
    build = Path(args.build)
    if not build.is_dir():
        parser.error(f"--build {build}: no such folder; run `make workbook` first")
    text = build_report(build)
    (build / "report.md").write_text(text)
    (build / "report.html").write_text(to_html(text))
    print(f"wrote {build / 'report.md'} and {build / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
