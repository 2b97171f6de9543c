"""Fault attribution: per fault, the first rank and node to fail, the category, and the evidence.

::

    python -m nvrx_lab.observe.attribute RUN_DIR [--json]

reads every event stream (``*.jsonl``) under RUN_DIR, the launcher's restart log in it (``launcher_failure``,
``trace_dump``, ``health``), the in-process wrapper's ``restart`` records, the trainer's ``crash`` and ``start`` events
(which place each rank on a node and host), and the flight-recorder dumps beside them, and prints one block a fault::

    fault 1 at 19:10:50: rank 1 (node 0, host ip-10-0-0-1): hang in gloo:all_gather #184 (...) [launcher restart 3]
        19:10:53.392 launcher_failure rank 0: reason=hang, detail=missed heartbeats for 3.1 s (timeout 3 s), ...
        flight recorder rank 1: process group 0 entered #183 (gloo:all_reduce), completed #183: never entered #184

A fault is the evidence of one recovery: a launcher restart (its ``launcher_failure`` events, one
``restart_count``), an in-process restart (every rank's ``restart`` record of one attempt), a pod restart, a failed
health check, or crashes nothing restarted. Categories: :data:`~nvrx_lab.observe.attribute_rules.CATEGORIES`; how each
is decided: :mod:`nvrx_lab.observe.attribute_judges`. The injector's ``fault`` events (what a test injected) are never
read: the verdicts come from the evidence, and a test compares the two.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from nvrx_lab.cli import Parser
from nvrx_lab.observe.attribute_fr import find_dumps
from nvrx_lab.observe.attribute_judges import JUDGES
from nvrx_lab.observe.attribute_rules import CATEGORIES, Group, Run, Verdict

__all__ = ["CATEGORIES", "Verdict", "attribute", "attribute_events", "main", "read_stream"]

EVIDENCE_KINDS = ("start", "step", "crash", "launcher_failure", "restart", "pod_restart", "health")
"""A ``*.jsonl`` file with none of these is no event stream of a run (e.g. the injector's ``faults_fired.jsonl``)."""
NEARBY = ("trace_dump", "launcher_rendezvous")
MERGE_S = 10.0
"""Two layers reporting one fault (the in-process wrapper and the launcher): same rank and category, this close."""


def read_stream(path: str | Path) -> list[dict]:
    """The events of one stream, in file order: torn or foreign lines skipped (each event has ``t``, ``kind``)."""
    events = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for text in f:
            try:
                e = json.loads(text)
            except ValueError:
                continue
            if isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("t"), (int, float)):
                events.append(e)
    return events


def _clustered(events: list[dict], key, gap_s: float) -> list[list[dict]]:
    """``events`` in clusters of one ``key`` each, a new cluster where the same key comes back after ``gap_s``."""
    clusters: dict = {}
    out: list[list[dict]] = []
    for e in sorted(events, key=lambda e: e["t"]):
        k = key(e)
        if k not in clusters or e["t"] - clusters[k][0]["t"] > gap_s:
            clusters[k] = [e]
            out.append(clusters[k])
        else:
            clusters[k].append(e)
    return out


def groups(events: list[dict]) -> list[Group]:
    """The faults of one stream, each with its evidence, oldest first."""
    of = lambda kind: [e for e in events if e["kind"] == kind]  # noqa: E731
    found = []
    for c in _clustered(of("launcher_failure"), lambda e: e.get("restart_count"), 60.0):
        n = c[0].get("restart_count")
        found.append(Group("launcher", f"launcher restart {n}" if n else f"launcher: {c[0].get('action', 'no restart')}",
                           c[0]["t"], c))
    for c in _clustered(of("restart"), lambda e: (e.get("iteration"), e.get("t_fault")), 60.0):
        found.append(Group("inprocess", f"in-process restart (attempt {c[0].get('iteration')})", c[0]["t"], c))
    found += [Group("pod", f"pod restart {e.get('restart_count')}", e["t"], [e]) for e in of("pod_restart")]
    failed = [e for e in of("health") if e.get("status") == "failed"]
    found += [Group("health", "health check", c[0]["t"], c) for c in _clustered(failed, lambda e: e.get("host"), 5.0)]
    found.sort(key=lambda g: g.t)
    crashes = of("crash")
    since = float("-inf")
    for i, g in enumerate(found):  # a crash comes before the report of it (the process ends after its crash event)
        g.since = since
        g.crashes = [c for c in crashes if since < c["t"] <= g.t]
        until = found[i + 1].t if i + 1 < len(found) else float("inf")
        g.extra = [e for e in events if e["kind"] in NEARBY and g.t - 1.0 <= e["t"] < min(until, g.t + 30.0)]
        since = g.t
    taken = {id(c) for g in found for c in g.crashes}
    rest = [c for c in crashes if id(c) not in taken]  # crashes no restart layer answered: the job's end, say
    for c in _clustered(rest, lambda e: 0, 60.0):
        before = [g.t for g in found if g.t < c[0]["t"]]
        found.append(Group("crash", "crash (not restarted)", c[-1]["t"], [], max(before, default=float("-inf")), c))
    return sorted(found, key=lambda g: g.t)


def _merged(verdicts: list[Verdict]) -> list[Verdict]:
    """One verdict a fault where two layers reported it (same rank and category, within :data:`MERGE_S`)."""
    out: list[Verdict] = []
    for v in sorted(verdicts, key=lambda v: v.t):
        last = out[-1] if out else None
        if (last is not None and (last.rank, last.category) == (v.rank, v.category) and v.t - last.t < MERGE_S
                and last.via.split()[0] != v.via.split()[0]):
            last.via, last.evidence = f"{last.via}, {v.via}", last.evidence + v.evidence
        else:
            out.append(v)
    return out


def attribute_events(events: list[dict], folder: str | Path | None = None, stream: str = "") -> list[Verdict]:
    """The verdicts of one stream's ``events``; ``folder``: where its dumps lie (``None``: only the paths the events name)."""
    run = Run(events, find_dumps(Path(folder)) if folder is not None and Path(folder).is_dir() else [])
    verdicts = _merged([JUDGES[g.kind](run, g) for g in groups(events)])
    for v in verdicts:
        v.stream = stream
    return verdicts


def streams(run_dir: str | Path) -> dict[Path, list[dict]]:
    """Every event stream under ``run_dir`` (a folder, searched recursively, or one file): ``{path: events}``."""
    root = Path(run_dir)
    paths = [root] if root.is_file() else sorted(root.rglob("*.jsonl"))
    found = {p: read_stream(p) for p in paths}
    return {p: ev for p, ev in found.items() if any(e["kind"] in EVIDENCE_KINDS for e in ev)}


def attribute(run_dir: str | Path) -> list[Verdict]:
    """Every fault of every event stream under ``run_dir``, stream by stream, oldest first."""
    root = Path(run_dir)
    out = []
    for path, events in streams(root).items():
        name = str(path.relative_to(root)) if root.is_dir() else path.name
        out += attribute_events(events, path.parent, name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m nvrx_lab.observe.attribute", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's folder: its event streams (*.jsonl) and dumps")
    p.add_argument("--json", action="store_true", help="the verdicts as one JSON list")
    args = p.parse_args(argv)
    root = Path(args.run_dir)
    if not root.exists():
        print(f"error: RUN_DIR {root}: no such folder", file=sys.stderr)
        return 2
    found = streams(root)
    if not found:
        print(f"error: RUN_DIR {root}: no event stream in it (*.jsonl files of nvrx_lab events)", file=sys.stderr)
        return 2
    verdicts = attribute(root)
    if args.json:
        print(json.dumps([dataclasses.asdict(v) for v in verdicts], indent=1))
        return 0
    for path in found:
        name = str(path.relative_to(root)) if root.is_dir() else path.name
        mine = [v for v in verdicts if v.stream == name]
        print(f"{name}: {len(mine) or 'no'} fault{'' if len(mine) == 1 else 's'}")
        for n, v in enumerate(mine, 1):
            print("  " + v.headline(n))
            print("\n".join(f"      {e}" for e in v.evidence))
    return 0


if __name__ == "__main__":
    sys.exit(main())
