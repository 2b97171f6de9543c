"""Reliability cases: the layers under crashes, corruption, full disks, soaks and bad input
=========================================================================================

Each case runs real processes on real files and returns one :class:`Row`: how many trials held
what the case promises, and why the others did not. ``python -m nvrx_lab.bench reliability`` runs
them at full counts and prints the table the README carries; ``tests/test_reliability_*.py`` run
the same functions with small counts.

One module a family of cases:

* :mod:`.checkpoint` — SIGKILL of the trainer or the writer at random moments of a save,
  corrupted checkpoints, a full disk and a read-only folder mid-run;
* :mod:`.local` — a job saving local checkpoints SIGKILLed mid-replication, half the time with a node's memory;
* :mod:`.restarts` — 100 in-process restarts in the same processes, 50 launcher restarts,
  a long phase inside a section that must not look like a hang;
* :mod:`.trainer` — the trainer under a fault during a save, a load and a restart;
* :mod:`.bad_input` — flags, YAML, ``JobSpec`` fields and checkpoint folders that must be refused.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    """One case's result."""

    case: str
    """Short name, e.g. ``sigkill trainer mid-save``."""
    holds: str
    """What must hold in every trial."""
    trials: int = 0
    passed: int = 0
    seconds: float = 0.0
    """Wall time of the whole case."""
    figures: dict = field(default_factory=dict)
    """Measured numbers worth a column (e.g. ``{"rss_growth_pct": 0.4}``)."""
    failures: list[str] = field(default_factory=list)
    """One line per trial that did not hold (at most the first 20 are kept)."""

    @property
    def ok(self) -> bool:
        return self.trials > 0 and self.passed == self.trials

    def check(self, condition: bool, why: str) -> bool:
        """Count one trial; on failure remember ``why``."""
        self.trials += 1
        if condition:
            self.passed += 1
        elif len(self.failures) < 20:
            self.failures.append(why)
        return condition

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


@contextmanager
def logger_at(name: str, level: int, handler: logging.Handler | None = None):
    """Logger ``name`` at ``level`` (with ``handler`` attached) inside the block, as it was after."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    if handler is not None:
        logger.addHandler(handler)
    try:
        yield logger
    finally:
        if handler is not None:
            logger.removeHandler(handler)
        logger.setLevel(before)


class _AsInjected(logging.Filter):
    def __init__(self, case: str, prefix: str):
        super().__init__()
        self.case, self.prefix = case, prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(self.prefix) and not str(record.msg).startswith("(expected"):
            record.msg = f"(expected: injected by the case '{self.case}') {record.msg}"
        return True


@contextmanager
def as_injected(row: Row, name: str = "nvrx_lab.checkpoint"):
    """Errors the case provokes on purpose, labelled as such in the log (a bench run prints no real-looking
    failure): every record of ``name``'s loggers inside the block is prefixed with the case's name."""
    label = _AsInjected(row.case, name)
    handlers = [h for h in logging.getLogger().handlers] or [logging.lastResort]
    for h in handlers:
        h.addFilter(label)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(label)


@contextmanager
def timed(row: Row):
    t0 = time.monotonic()
    try:
        yield row
    finally:
        row.seconds = time.monotonic() - t0


__all__ = ["Row", "as_injected", "logger_at", "timed"]
