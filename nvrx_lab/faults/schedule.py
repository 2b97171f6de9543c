"""The fault grammar: :data:`KINDS`, :class:`Fault`, :func:`parse_schedule` (see :mod:`nvrx_lab.faults`)."""


from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from nvrx_lab.cli import Settings

KINDS = ("exception", "hang", "sigkill", "oom", "slow", "hang_socket", "hang_native", "sigkill_all", "exit", "pause",
         "hang_spin", "slow_sleep")
"""The one vocabulary of faults (see the module docs)."""
NUMBER_ARG = {"slow": ("FACTOR", "a number > 1", "1.5"), "slow_sleep": ("FACTOR", "a number > 1", "1.5"),
              "pause": ("SECONDS", "a number > 0", "5"),
              "exit": ("CODE", "an integer 0..255", "3")}
"""Kinds whose last field is a number, not a phase."""
PHASES = ("step", "save", "load")
TRAINER_KINDS = ("exception", "hang", "sigkill", "oom", "slow")
"""What the trainer's ``--faults`` documents (every kind works; these are the ones its tests and notebooks use)."""


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises."""


ENTRY = re.compile(r"""
    (?P<rank>\d+|\*)
    (?: : (?P<attempts> \* | \d+ (?:-\d+)? ) )?
    : (?P<step>\d+)
    : (?P<kind>[^:]+)
    (?: : (?P<arg>[^:]+) )?
""", re.VERBOSE)
"""One schedule entry, ``RANK[:ATTEMPTS]:STEP:KIND[:ARG]`` (see the module docstring)."""
EVERY_RANK = -1


@dataclass(frozen=True)
class Fault:
    rank: int
    """The rank that injects it; :data:`EVERY_RANK` (``*``): every rank."""
    step: int
    kind: str
    phase: str = "step"
    attempts: range | None = None
    """Restart attempts in which the fault fires; ``None``: once, remembered across restarts."""
    value: float = 0.0
    """``slow``: the factor; ``pause``: seconds; ``exit``: the code."""

    @property
    def factor(self) -> float:
        return self.value if self.kind in ("slow", "slow_sleep") else 0.0

    @property
    def id(self) -> str:
        attempts = "" if self.attempts is None else f"{_attempts_text(self.attempts)}:"
        tail = f":{self.value:g}" if self.kind in NUMBER_ARG else (f":{self.phase}" if self.phase != "step" else "")
        rank = "*" if self.rank == EVERY_RANK else str(self.rank)
        return f"{rank}:{attempts}{self.step}:{self.kind}{tail}"

    def hits(self, rank: int) -> bool:
        return self.rank in (rank, EVERY_RANK)

    def fires_in(self, attempt: int) -> bool:
        return self.attempts is None or attempt in self.attempts


def _attempts_text(attempts: range) -> str:
    first, last = attempts.start, attempts.stop - 1
    return str(first) if first == last else f"{first}-{last}"


def _attempts(text: str | None, entry: str) -> range | None:
    if text is None:
        return None
    if text == "*":
        return range(0, 1 << 30)
    first, _, last = text.partition("-")
    if int(last or first) < int(first):
        raise ValueError(f"--faults entry {entry!r}: attempts {text!r} is an empty range; allowed: N, A-B with A <= B, or *")
    return range(int(first), int(last or first) + 1)


def _value(kind: str, text: str | None, entry: str) -> float:
    """The number a ``slow``, ``pause`` or ``exit`` entry carries, checked."""
    try:
        value = float(text) if text is not None else float("nan")
    except ValueError:
        value = float("nan")
    slow = lambda v: 1.0 < v < float("inf")  # noqa: E731
    ok = {"slow": slow, "slow_sleep": slow, "pause": lambda v: 0.0 < v < float("inf"),
          "exit": lambda v: v == int(v) and 0 <= v <= 255}[kind]
    if not ok(value):
        name, what, example = NUMBER_ARG[kind]
        raise ValueError(f"--faults entry {entry!r}: kind {kind} needs {name}, {what}, as RANK:STEP:{kind}:{name}, e.g. "
                         f"1:20:{kind}:{example} (got {text!r})")
    return value


def parse_schedule(spec: str) -> list[Fault]:
    """``"1:5:exception,0:9:hang:load"`` → faults; a clear ``ValueError`` names a bad entry and what is valid."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        m = ENTRY.fullmatch(entry)
        if m is None:
            raise ValueError(f"--faults entry {entry!r}: expected RANK:STEP:KIND[:PHASE] or RANK:ATTEMPTS:STEP:KIND[:PHASE], "
                             "RANK and STEP non-negative integers (RANK may be *), ATTEMPTS N, A-B or *, e.g. 1:5:exception")
        kind, arg = m["kind"], m["arg"]
        if kind not in KINDS:
            raise ValueError(f"--faults entry {entry!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
        value, phase = (_value(kind, arg, entry), "step") if kind in NUMBER_ARG else (0.0, arg or "step")
        if phase not in PHASES:
            raise ValueError(f"--faults entry {entry!r}: phase {phase!r} is not one of {', '.join(PHASES)}")
        rank = EVERY_RANK if m["rank"] == "*" else int(m["rank"])
        faults.append(Fault(rank, int(m["step"]), kind, phase, _attempts(m["attempts"], entry), value))
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


@dataclass
class FaultConfig(Settings):
    """Deterministic faults (the trainer's ``--faults``)."""

    schedule: str = field(default="", metadata={"flag": "faults"})
    """Deterministic faults RANK:STEP:KIND[:PHASE],... (kinds: exception, hang, sigkill, oom; phases: step, save,
    load) or RANK:STEP:slow:FACTOR (the rank computes FACTOR times slower from then on); each fires once
    (nvrx_lab.faults lists every kind)."""

    def __post_init__(self):
        self.faults = parse_schedule(self.schedule)  # a malformed entry is an error now, naming it
        for f in self.faults:
            if f.attempts is not None:
                raise ValueError(f"--faults entry {f.id!r}: expected RANK:STEP:KIND[:PHASE]; ATTEMPTS is for the demo "
                                 "workers: here each fault fires once, remembered across restarts")

