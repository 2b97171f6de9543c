"""Deterministic fault injection: one grammar for fault schedules, and the trainer's injector.

The one fault grammar of ``nvrx_lab``: the trainer's ``--faults``, :class:`~nvrx_lab.eks.spec.JobSpec`'s
``faults``, the benchmarks and both demo workers parse their schedules here. A schedule is
comma-separated entries ``RANK[:ATTEMPTS]:STEP:KIND[:PHASE]``, e.g. ``1:5:exception,1:12:sigkill``,
or ``RANK:STEP:slow:FACTOR``, or generated from a seed with :func:`make_schedule`:

* ``RANK``     — the (initial) rank that injects it;
* ``ATTEMPTS`` — restart attempts in which it fires: ``N``, ``A-B`` or ``*`` (every attempt, the default).
  Only the demo workers, which know their attempt, accept it (``1:0:5:exception``); the trainer
  fires each fault once instead, remembered across restarts;
* ``STEP``     — the step it fires at;
* ``KIND``     — what happens (below); a demo worker adds kinds of its own (see its docstring);
* ``PHASE``    — where in that step (below; the trainer only);
* ``FACTOR``   — kind ``slow`` only, in the place of ``PHASE``: how many times slower, a number > 1
  (``1:20:slow:1.5``); a slow fault always fires before its step.

Kinds of the trainer (:class:`FaultInjector`):

* ``exception`` — raise :class:`InjectedFault` (a Python error in the training step)
* ``hang``      — sleep far past any timeout (a rank stuck in Python-level blocking code)
* ``sigkill``   — ``SIGKILL`` to the own process (a crash that takes the interpreter)
* ``oom``       — allocate, then raise ``MemoryError`` (a stand-in for an out-of-memory error)
* ``slow``      — the rank computes ``FACTOR``× slower from that step on (:mod:`nvrx_lab.faults.slowdown`):
  a straggler, alive and slow, which only :mod:`nvrx_lab.straggler` notices

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
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KINDS = ("exception", "hang", "sigkill", "oom", "slow")
PHASES = ("step", "save", "load")


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises."""


ENTRY = re.compile(r"""
    (?P<rank>\d+)
    (?: : (?P<attempts> \* | \d+ (?:-\d+)? ) )?
    : (?P<step>\d+)
    : (?P<kind>[^:]+)
    (?: : (?P<phase>[^:]+) )?
""", re.VERBOSE)
"""One schedule entry, ``RANK[:ATTEMPTS]:STEP:KIND[:PHASE]`` (see the module docstring)."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str
    phase: str = "step"
    attempts: range | None = None
    """Restart attempts in which the fault fires; ``None``: every attempt."""
    factor: float = 0.0
    """Kind ``slow``: how many times slower the rank computes (> 1)."""

    @property
    def id(self) -> str:
        attempts = "" if self.attempts is None else f"{_attempts_text(self.attempts)}:"
        tail = f":{self.factor:g}" if self.factor else (f":{self.phase}" if self.phase != "step" else "")
        return f"{self.rank}:{attempts}{self.step}:{self.kind}{tail}"

    def fires_in(self, attempt: int) -> bool:
        return self.attempts is None or attempt in self.attempts


def _attempts_text(attempts: range) -> str:
    first, last = attempts.start, attempts.stop - 1
    return str(first) if first == last else f"{first}-{last}"


def _attempts(text: str | None, entry: str) -> range | None:
    if text is None or text == "*":
        return None
    first, _, last = text.partition("-")
    if int(last or first) < int(first):
        raise ValueError(f"--faults entry {entry!r}: attempts {text!r} is an empty range; allowed: N, A-B with A <= B, or *")
    return range(int(first), int(last or first) + 1)


def _factor(text: str | None, entry: str) -> float:
    """FACTOR of a ``slow`` entry: a number > 1."""
    try:
        factor = float(text) if text is not None else 0.0
    except ValueError:
        factor = 0.0
    if not 1.0 < factor < float("inf"):
        raise ValueError(f"--faults entry {entry!r}: kind slow needs FACTOR, a number > 1, as RANK:STEP:slow:FACTOR, "
                         f"e.g. 1:20:slow:1.5 (got {text!r})")
    return factor


def parse_schedule(spec: str, kinds: tuple[str, ...] = KINDS, phases: tuple[str, ...] = PHASES,
                   with_attempts: bool = False, factor_kinds: tuple[str, ...] | None = None) -> list[Fault]:
    """``"1:5:exception,0:9:hang:load"`` → faults; a clear ``ValueError`` names the bad entry.

    A caller says what it can inject: its ``kinds``, its ``phases``, and whether it knows its restart
    attempt (``with_attempts``), and which kinds take a FACTOR as their last field (``factor_kinds``;
    default: ``slow`` with the trainer's kinds, none with a demo worker's own, whose ``slow`` is a pause);
    the defaults are the trainer's."""
    factor_kinds = ("slow",) if factor_kinds is None and kinds == KINDS else (factor_kinds or ())
    form = ("RANK[:ATTEMPTS]" if with_attempts else "RANK") + ":STEP:KIND" + ("[:PHASE]" if len(phases) > 1 else "")
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        m = ENTRY.fullmatch(entry)
        if m is None:
            numbers = "RANK and STEP non-negative integers" + (", ATTEMPTS N, A-B or *" if with_attempts else "")
            raise ValueError(f"--faults entry {entry!r}: expected {form}, {numbers}, e.g. 1:5:{kinds[0]}")
        kind, phase = m["kind"], m["phase"] or "step"
        factor = _factor(m["phase"], entry) if kind in factor_kinds else 0.0
        phase = "step" if factor else phase
        if m["attempts"] is not None and not with_attempts:
            raise ValueError(f"--faults entry {entry!r}: expected {form}; ATTEMPTS ({m['attempts']!r}) is for the "
                             "demo workers: here each fault fires once, remembered across restarts")
        if kind not in kinds:
            raise ValueError(f"--faults entry {entry!r}: kind {kind!r} is not one of {', '.join(kinds)}")
        if phase not in phases:
            raise ValueError(f"--faults entry {entry!r}: phase {phase!r} is not one of {', '.join(phases)}")
        faults.append(Fault(int(m["rank"]), int(m["step"]), kind, phase, _attempts(m["attempts"], entry), factor))
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


def fired_faults(state_file: str | os.PathLike | None) -> list[dict]:
    """The faults a run fired so far, oldest first: ``{"id", "t"}`` (and ``kind``, ``rank``, ``step``)."""
    if not state_file or not Path(state_file).exists():
        return []
    fired = []
    for line in Path(state_file).read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill mid-write
        if isinstance(entry, dict) and "id" in entry:
            fired.append(entry)
    return fired


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
        return set(self._fired_here) | {f["id"] for f in fired_faults(self.state_file)}

    def _record(self, fault: Fault) -> float:
        """Remember ``fault`` as fired (before it acts); returns the moment, the fault event's ``t``."""
        t = time.time()
        self._fired_here.add(fault.id)
        if self.state_file:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.state_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps({"id": fault.id, "t": t, "kind": fault.kind, "rank": fault.rank,
                                          "step": fault.step}) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        return t

    def __call__(self, step: int) -> None:
        self.during("step", step)

    def during(self, phase: str, step: int) -> None:
        fault = self.mine.get((phase, step))
        if fault is None or fault.id in self.fired():
            return
        t = self._record(fault)
        if self.emit:
            self.emit("fault", t=t, step=step, fault=fault.kind, target=fault.rank, phase=phase,
                      **({"factor": fault.factor} if fault.kind == "slow" else {}))
        where = f"step {step}" if phase == "step" else f"the {phase} of step {step}"
        print(f"[rank {self.rank}] FAULT injected: {fault.kind} in {where} ({fault.id})", file=sys.stderr, flush=True)
        if fault.kind == "exception":
            raise InjectedFault(f"injected exception on rank {self.rank} at step {step}")
        if fault.kind == "hang":
            time.sleep(self.hang_s)
        elif fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "slow":
            from nvrx_lab.faults.slowdown import slow_down

            slow_down(fault.factor)
        elif fault.kind == "oom":
            hog = bytearray(self.oom_bytes)  # touch real memory before failing, as an allocator would
            del hog
            raise MemoryError(f"injected memory exhaustion on rank {self.rank} at step {step}")
