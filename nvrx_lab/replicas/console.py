"""What a :mod:`.local` run says while it runs: each fault, each heal, and at the end what the faults cost the others.

The groups' own output goes to ``OUT/replica<r>.log``; their event streams (``replica<r>.jsonl``) are followed here, so
the console shows, as they happen::

    [nvrx_lab.replicas] FAULT replica 1: exception in step 4 (rank 1 of the job)
    [nvrx_lab.replicas] replica 1 dropped: it failed (InjectedFault: ...)        (the coordinator's own line)
    [nvrx_lab.replicas] replica 1 healed from replica 0 before step 6 (its state in 0.01 s), 3.1 s after its fault

and once every group has ended, one ``REPLICAS`` line: the faults, the survivors' longest pause against their median
step, the steps redone, and whether every replacement healed.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import threading
from pathlib import Path

from nvrx_lab.observe.events import read_events

from . import ledger

POLL_S = 0.2


class Narrator:
    """Follows ``out/replica*.jsonl`` in a thread of its own (:meth:`stop` ends it after a last read)."""

    def __init__(self, out: Path, replicas: int):
        self.out, self.replicas = out, replicas
        self._read_to: dict[int, int] = {r: 0 for r in range(replicas)}  # bytes of each stream already said
        self._faults: dict[int, float] = {}  # replica -> the moment of its last fault
        self._healed: set[tuple[int, int]] = set()  # (replica, step) heals said
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True, name="nvrx-replicas-console")
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):  # a periodic reader of growing files, not a wait for one event
            self._read()
        self._read()

    def _read(self) -> None:
        """The lines each stream gained since the last read (only whole lines: a writer may be mid-line)."""
        for r in range(self.replicas):
            try:
                with open(self.out / f"replica{r}.jsonl", "rb") as f:
                    f.seek(self._read_to[r])
                    new = f.read()
            except OSError:
                continue
            whole = new[:new.rfind(b"\n") + 1]
            self._read_to[r] += len(whole)
            for line in whole.splitlines():
                with contextlib.suppress(ValueError):
                    self._say(r, json.loads(line))

    def _say(self, replica: int, e: dict) -> None:
        if e["kind"] == "fault":
            self._faults[replica] = e["t"]
            print(f"[nvrx_lab.replicas] FAULT replica {replica}: {e['fault']} in step {e['step']} (rank {e['target']} of "
                  f"the job)", file=sys.stderr, flush=True)
        elif e["kind"] == "healed" and (replica, e["step"]) not in self._healed:  # once a group, not once a rank
            self._healed.add((replica, e["step"]))
            after = f", {e['t'] - self._faults[replica]:.1f} s after its fault" if replica in self._faults else ""
            print(f"[nvrx_lab.replicas] replica {replica} healed from replica {e['donor']} before step {e['step']} "
                  f"(its state in {e['seconds']:.2f} s){after}", file=sys.stderr, flush=True)

    def stop(self) -> str:
        """End the follower; the run's one-line summary (also printed)."""
        self._stop.set()
        self._thread.join(10)
        line = summary(self.out, self.replicas)
        print(line, flush=True)
        return line


def summary(out: Path, replicas: int) -> str:
    """The faults, the survivors' longest pause against their median step, the steps redone, the heals."""
    coord = read_events(out / "coordinator.jsonl") if (out / "coordinator.jsonl").exists() else []
    lost = [e for e in coord if e["kind"] == "replica_lost"]
    redone = ledger.redone_steps(coord)
    gaps, healed = [], 0
    for r in range(replicas):
        path = out / f"replica{r}.jsonl"
        events = read_events(path) if path.exists() else []
        steps = sorted((e for e in events if e["kind"] == "step"), key=lambda e: e["step"])
        gaps += [b["t"] - a["t"] for a, b in zip(steps, steps[1:], strict=False) if b["step"] == a["step"] + 1]
        healed += len({e["step"] for e in events if e["kind"] == "healed"})  # every rank of the group heals
    if not gaps:
        return "REPLICAS no step committed"
    pause = f"longest pause {max(gaps):.2f} s against a median step of {statistics.median(gaps):.3f} s"
    return (f"REPLICAS {len(lost)} replica groups dropped, {healed} replacements healed; the others' {pause}; "
            f"{redone} steps redone without the lost rows")
