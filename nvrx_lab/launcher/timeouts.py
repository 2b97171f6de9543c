"""Heartbeat and section timeouts: what counts as a hang, and how long to wait for one.

A rank is *hung* when it stays silent for longer than it is allowed to:

* before its first heartbeat, the **initial** timeout (start-up: imports, ``init_process_group``,
  checkpoint load) counted from ``init_workload_monitoring``;
* between heartbeats, the **steady** timeout;
* inside an open section (``start_section("checkpoint")`` ... ``end_section("checkpoint")``), that
  section's own timeout counted from the section's start — the heartbeat timeout is suspended, so a
  legitimate 10 s save inside a 30 s section is never a hang. A section without a timeout is
  unbounded (as NVRx treats ``null``) until :func:`calculate` gives it one.

:func:`find_hang` is the whole decision, a pure function of a :class:`RankClock` and
:class:`Timeouts`; :func:`calculate` derives timeouts from observed gaps × a safety factor, which
the client stores with the checkpoint so a restarted job keeps them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass
class Timeouts:
    """The limits a rank monitor enforces (seconds; ``None`` = no limit)."""

    initial: float | None = 60.0
    """From ``init_workload_monitoring`` to the first heartbeat."""
    steady: float | None = 30.0
    """Between two heartbeats outside any section."""
    sections: dict[str, float] = field(default_factory=dict)
    """Per section name, from ``start_section`` to ``end_section``."""

    def __post_init__(self) -> None:
        for name, value in (("initial", self.initial), ("steady", self.steady), *self.sections.items()):
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"timeout {name!r} must be a positive number of seconds or None, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Timeouts:
        unknown = set(d) - {"initial", "steady", "sections"}
        if unknown:
            raise ValueError(f"unknown timeout keys {sorted(unknown)}; valid: initial, steady, sections")
        return cls(initial=d.get("initial"), steady=d.get("steady"), sections=dict(d.get("sections") or {}))


def parse_section_timeouts(text: str) -> dict[str, float]:
    """``"checkpoint=30,eval=60"`` -> ``{"checkpoint": 30.0, "eval": 60.0}`` (``--section-timeouts``)."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--section-timeouts: expected name=seconds, got {item!r} (e.g. checkpoint=30,eval=60)")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"--section-timeouts: {name.strip()!r} needs a number of seconds, got {value!r}") from None
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"--section-timeouts: {name.strip()!r} must be > 0 seconds, got {value!r}")
        out[name.strip()] = seconds
    return out


@dataclass
class RankClock:
    """What a monitor knows about one rank's liveness (``time.monotonic()`` seconds)."""

    connected_at: float
    """When the rank called ``init_workload_monitoring``."""
    last_heartbeat: float | None = None
    """Last heartbeat, ``None`` before the first."""
    last_section_end: float | None = None
    """When the most recent section closed (silence inside a section is not counted afterwards)."""
    open_sections: dict[str, float] = field(default_factory=dict)
    """Open section name -> start time."""


def find_hang(clock: RankClock, timeouts: Timeouts, now: float) -> tuple[str, float] | None:
    """``(reason, silent_seconds)`` if the rank exceeded a limit at ``now``, else ``None``."""
    if clock.open_sections:
        for name, started in clock.open_sections.items():
            limit = timeouts.sections.get(name)
            if limit is not None and now - started > limit:
                return f"section {name!r} open for {now - started:.1f} s > {limit:g} s", now - started
        return None
    if clock.last_heartbeat is None:
        since = max(clock.connected_at, clock.last_section_end or clock.connected_at)
        if timeouts.initial is not None and now - since > timeouts.initial:
            return f"no first heartbeat for {now - since:.1f} s (initial timeout {timeouts.initial:g} s)", now - since
        return None
    since = max(clock.last_heartbeat, clock.last_section_end or clock.last_heartbeat)
    if timeouts.steady is not None and now - since > timeouts.steady:
        return f"missed heartbeats for {now - since:.1f} s (timeout {timeouts.steady:g} s)", now - since
    return None


@dataclass
class Observed:
    """Longest intervals a client has seen; the input of :func:`calculate`."""

    initial: float | None = None
    """From init to the first heartbeat."""
    steady: float | None = None
    """Longest gap between heartbeats outside sections."""
    sections: dict[str, float] = field(default_factory=dict)
    """Longest duration of each section."""

    def merge(self, other: Observed) -> Observed:
        pick = lambda a, b: b if a is None else a if b is None else max(a, b)  # noqa: E731
        names = set(self.sections) | set(other.sections)
        return Observed(pick(self.initial, other.initial), pick(self.steady, other.steady),
                        {n: pick(self.sections.get(n), other.sections.get(n)) for n in names})


def calculate(observed: Observed, current: Timeouts, safety_factor: float = 5.0, floor: float = 1.0) -> Timeouts:
    """New timeouts = longest observed interval × ``safety_factor`` (at least ``floor`` s).

    Intervals never observed keep their ``current`` value; the initial timeout never shrinks below
    the current one (a restart may load a checkpoint that the first start did not).
    """
    if safety_factor < 1:
        raise ValueError(f"safety_factor must be >= 1, got {safety_factor}")
    scale = lambda x: max(floor, x * safety_factor)  # noqa: E731
    initial = current.initial
    if observed.initial is not None:
        initial = scale(observed.initial) if initial is None else max(initial, scale(observed.initial))
    steady = current.steady if observed.steady is None else scale(observed.steady)
    sections = dict(current.sections)
    sections.update({n: scale(v) for n, v in observed.sections.items()})
    return Timeouts(initial=initial, steady=steady, sections=sections)
