"""The restart log: what each restart cost and why it happened
=============================================================

One :class:`RestartRecord` per restart on every rank, emitted as one JSON event
``emit("restart", ...)`` on the trainer's event stream (:mod:`nvrx_lab.observe.events`). The record is
emitted when the restarted attempt first calls ``ping()`` (so ``reload_s`` reported by the
function with ``call_wrapper.record("reload_s", s)`` and ``back_s`` — fault to training again —
are known), or when that attempt ends before its first ping.

When the limits are reached (``max_iterations``, ``min_world_size``) the wrapper raises
:class:`RestartLimitError`, whose message lists every restart and its cause.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

CAUSE_PRIORITY = {"hard_timeout": 0, "dead": 1, "unhealthy": 2, "hang": 3, "exception": 4}
"""Several ranks may report one fault (a SIGKILL also breaks the peers' collectives): the root
cause is the report with the best priority here, then a hang of a rank not waiting in a collective
(the peers waiting for it report one too), then the earliest."""


def root_cause(faults: list[dict]) -> dict:
    if not faults:
        return {"cause": "unknown", "rank": -1, "detail": "", "t": None}
    return min(faults, key=lambda f: (CAUSE_PRIORITY.get(f["cause"], 9), bool(f.get("waiting")), f["t"]))


@dataclass
class RestartRecord:
    """One restart as seen by one rank."""

    iteration: int
    """The attempt that ended (the next one is ``iteration + 1``)."""
    cause: str
    """``exception``, ``hang``, ``dead``, ``hard_timeout``, ``unhealthy`` or ``unknown``."""
    fault_rank: int
    """Initial rank whose fault caused the restart."""
    detail: str
    """The exception's repr or the monitor's finding."""
    t_fault: float | None
    """Wall time of the fault report (for a hang: the last ping)."""
    detect_s: float = 0.0
    """Fault -> this rank's attempt interrupted."""
    abort_s: float = 0.0
    """Tearing the attempt down: process group destroyed, store client closed."""
    health_s: float = 0.0
    """Health checks."""
    rendezvous_s: float = 0.0
    """Meeting the survivors in the store and assigning ranks."""
    reload_s: float | None = None
    """Reported by the function (``call_wrapper.record("reload_s", s)``), e.g. checkpoint load."""
    back_s: float | None = None
    """Fault -> this rank's first ``ping()`` of the next attempt (a phase: the function has not resumed yet;
    the trainer's recovery figure runs to its first step, :mod:`nvrx_lab.train.resume`)."""
    world_size: int = 0
    """Active ranks in the next attempt."""
    new_rank: int | None = None
    """This process's rank in the next attempt (``None``: spare)."""
    reports: list = field(default_factory=list)
    """Every fault report of the attempt (cause, rank), root cause first."""
    cuda_peak_bytes: int | None = None
    """Peak CUDA memory this rank allocated during the attempt that ended (``None`` without CUDA)."""
    cuda_left_bytes: int | None = None
    """CUDA memory still allocated once that attempt was released: what the next one starts with."""
    trace_dump: str | None = None
    """Where this rank's abort dumped its flight recorder (or why it did not); ``None``: no abort, or no folder."""

    def fields(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        timing = ", ".join(f"{k} {v:.3f} s" for k, v in
                           (("detect", self.detect_s), ("abort", self.abort_s), ("health", self.health_s),
                            ("rendezvous", self.rendezvous_s)) if v is not None)
        dump = f"; flight recorder: {self.trace_dump}" if self.trace_dump else ""
        return (f"attempt {self.iteration}: {self.cause} on rank {self.fault_rank}: {self.detail[:300]} "
                f"({timing}){dump}")


class RestartLimitError(RuntimeError):
    """Raised on every rank when the wrapper gives up; ``.history`` holds the restart records."""

    def __init__(self, reason: str, history: list[RestartRecord]):
        self.reason, self.history = reason, list(history)
        lines = "\n".join(f"  {r.line()}" for r in history) or "  (no restart before this)"
        super().__init__(f"in-process restart gave up: {reason}\nrestarts ({len(history)}):\n{lines}")
