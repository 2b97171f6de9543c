"""Deterministic fault injection: a schedule of (rank, step, kind), each fault firing once.

A schedule is written ``RANK:STEP:KIND[:PHASE]`` comma-separated, e.g. ``1:5:exception,1:12:sigkill``,
or generated from a seed with :func:`make_schedule`. Kinds:

* ``exception`` — raise :class:`InjectedFault` (a Python error in the training step)
* ``hang``      — sleep far past any timeout (a rank stuck in Python-level blocking code)
* ``sigkill``   — ``SIGKILL`` to the own process (a crash that takes the interpreter)
* ``oom``       — allocate, then raise ``MemoryError`` (a stand-in for an out-of-memory error)

Phases, where the fault fires:

* ``step`` (default) — before training step ``STEP``;
* ``save``  — right after the save of step ``STEP`` was handed over (an async save is still being written);
* ``load``  — while the checkpoint of step ``STEP`` is being loaded (read, not yet applied).

Which faults fired is persisted in ``state_file`` (one JSON line per fault, appended *before*
the fault acts), so a rolled-back step does not fire the same fault again after a restart.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

KINDS = ("exception", "hang", "sigkill", "oom")
PHASES = ("step", "save", "load")


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str
    phase: str = "step"

    @property
    def id(self) -> str:
        return f"{self.rank}:{self.step}:{self.kind}" + (f":{self.phase}" if self.phase != "step" else "")


def parse_schedule(spec: str) -> list[Fault]:
    """``"1:5:exception,0:9:hang:load"`` → faults; a clear ``ValueError`` names the bad entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"--faults entry {entry!r}: expected RANK:STEP:KIND[:PHASE], e.g. 1:5:exception")
        rank, step, kind, phase = (*parts, "step") if len(parts) == 3 else parts
        if not (rank.isdigit() and step.isdigit()):
            raise ValueError(f"--faults entry {entry!r}: RANK and STEP must be non-negative integers")
        if kind not in KINDS:
            raise ValueError(f"--faults entry {entry!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
        if phase not in PHASES:
            raise ValueError(f"--faults entry {entry!r}: phase {phase!r} is not one of {', '.join(PHASES)}")
        faults.append(Fault(int(rank), int(step), kind, phase))
    return faults


def format_schedule(faults: list[Fault]) -> str:
    return ",".join(f.id for f in faults)


def make_schedule(count: int, world_size: int, steps: int, seed: int = 0, first_step: int = 5,
                  kinds: tuple[str, ...] = ("exception",), ranks: tuple[int, ...] | None = None) -> list[Fault]:
    """``count`` faults at distinct steps in ``[first_step, steps)``, kinds cycled, ranks drawn from
    ``ranks`` (default: every rank but 0, which often hosts stores)."""
    ranks = ranks or tuple(range(1, world_size)) or (0,)
    if count > steps - first_step:
        raise ValueError(f"count={count} faults do not fit in steps [{first_step}, {steps})")
    rng = random.Random(seed)
    at = sorted(rng.sample(range(first_step, steps), count))
    return [Fault(rng.choice(ranks), s, kinds[i % len(kinds)]) for i, s in enumerate(at)]


class FaultInjector:
    """Call with the step about to run (or ``during(phase, step)`` for a save or a load); fires
    this rank's scheduled fault for that step and phase once."""

    def __init__(self, faults: list[Fault], rank: int, state_file: str | os.PathLike | None = None,
                 emit: Callable[..., None] | None = None, hang_s: float = 3600.0, oom_bytes: int = 64 << 20):
        self.mine = {(f.phase, f.step): f for f in faults if f.rank == rank}
        self.rank, self.emit, self.hang_s, self.oom_bytes = rank, emit, hang_s, oom_bytes
        self.state_file = Path(state_file) if state_file else None
        self._fired_here: set[str] = set()

    def fired(self) -> set[str]:
        ids = set(self._fired_here)
        if self.state_file and self.state_file.exists():
            for line in self.state_file.read_text().splitlines():
                try:
                    ids.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    continue
        return ids

    def _record(self, fault: Fault) -> None:
        self._fired_here.add(fault.id)
        if self.state_file:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.state_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps({"id": fault.id, "t": time.time()}) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)

    def __call__(self, step: int) -> None:
        self.during("step", step)

    def during(self, phase: str, step: int) -> None:
        fault = self.mine.get((phase, step))
        if fault is None or fault.id in self.fired():
            return
        self._record(fault)
        if self.emit:
            self.emit("fault", step=step, fault=fault.kind, target=fault.rank, phase=phase)
        where = f"step {step}" if phase == "step" else f"the {phase} of step {step}"
        print(f"[rank {self.rank}] FAULT injected: {fault.kind} in {where} ({fault.id})", file=sys.stderr, flush=True)
        if fault.kind == "exception":
            raise InjectedFault(f"injected exception on rank {self.rank} at step {step}")
        if fault.kind == "hang":
            time.sleep(self.hang_s)
        elif fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "oom":
            hog = bytearray(self.oom_bytes)  # touch real memory before failing, as an allocator would
            del hog
            raise MemoryError(f"injected memory exhaustion on rank {self.rank} at step {step}")
