"""The event stream: one JSON line per event, appended by any process of a run.

The trainer writes steps, the layers write saves, commits, faults and restarts; goodput,
plots and reports only *read* this file. Lines are written with a single ``os.write`` on an
``O_APPEND`` descriptor, so concurrent writers on one host never interleave within a line.

Every event has ``t`` (wall-clock seconds), ``kind`` and ``rank``; the rest is per kind::

    {"t": 1764400000.1, "kind": "step", "rank": 0, "step": 12, "loss": 5.31, ...}
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

EmitFn = Callable[..., None]
"""What layers accept to report events: ``emit(kind, **fields)``."""


class EventLog:
    """Appends events to ``path``; a ``None`` path makes every ``emit`` a no-op.

    The file is opened once, here, and stays open for the life of the log: an ``emit`` is then a
    single ``os.write``. Opening and closing per event would leak a descriptor whenever an in-process
    restart's asynchronous interrupt lands between the ``open`` and the ``try`` that closes it (seen:
    one fd more after 100 restarts)."""

    def __init__(self, path: str | os.PathLike | None, rank: int = 0):
        self.path = Path(path) if path else None
        self.rank = rank
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._finalizer = weakref.finalize(self, os.close, self._fd)

    def emit(self, kind: str, **fields: Any) -> None:
        """Append one event; ``t`` defaults to now (a caller that recorded the moment elsewhere passes it)."""
        if self._fd is None:
            return
        event = {"t": time.time(), "kind": kind, "rank": self.rank, **fields}
        os.write(self._fd, (json.dumps(event, default=str) + "\n").encode())

    __call__ = emit

    def close(self) -> None:
        """Close the file (later ``emit`` calls are no-ops); also done when the log is collected."""
        if self._fd is not None:
            self._fd = None
            self._finalizer()


def read_events(path: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """All events of ``path`` (of one ``kind`` if given), in file order; a torn last line is skipped."""
    return list(iter_events(path, kind))


def last_run(events: list[dict]) -> list[dict]:
    """The events of the newest run in a file that several runs appended to.

    A run begins with ``start`` events carrying ``new_run: true`` (:mod:`nvrx_lab.train.runs`), one per rank;
    such an event from a rank already seen in the current run opens the next one. Restarts and
    resumes start with ``new_run: false`` and stay in their run."""
    runs: list[list[dict]] = [[]]
    seen: set = set()
    for e in events:
        if e.get("kind") == "start" and e.get("new_run") and e.get("rank") in seen:
            runs.append([])
            seen = set()
        runs[-1].append(e)
        seen.add(e.get("rank"))
    return runs[-1]


def last_launch(events: list[dict]) -> list[dict]:
    """The events of the newest launch: what one command started, the launcher's restarts included.

    A launch begins with ``start`` events of ``restart_count`` 0 (a launcher's restarts count up, an
    in-process restart emits none), one per rank; such an event from a rank already seen opens the next
    launch. A launch that continues a run (a relaunch onto its checkpoints) is a launch of its own here,
    and part of that run in :func:`last_run`."""
    launches: list[list[dict]] = [[]]
    seen: set = set()
    for e in events:
        if e.get("kind") == "start" and not e.get("restart_count") and e.get("rank") in seen:
            launches.append([])
            seen = set()
        launches[-1].append(e)
        if e.get("kind") == "start":
            seen.add(e.get("rank"))
    return launches[-1]


def iter_events(path: str | os.PathLike, kind: str | None = None) -> Iterator[dict]:
    p = Path(path)
    if not p.exists():
        return
    with p.open() as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or event.get("kind") == kind:
                yield event
