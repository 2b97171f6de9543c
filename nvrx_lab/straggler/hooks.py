"""The trainer's side of straggler detection: a :class:`~nvrx_lab.train.hooks.Hooks` built from the flags
===================================================================================================

``--straggler-interval N`` (0: off), ``--straggler-threshold T``, ``--straggler-action report|restart``.
:class:`StragglerHooks` installs the :class:`~.timers.ComputeTimer` when an attempt starts, closes a
step's timing after each step and, every ``N`` steps, asks the :class:`~.detector.Detector` for a
report. Then:

* rank 0 emits ``straggler_scores`` (every rank's mean time per step and scores, per section);
* a rank named a straggler (below ``T`` in two consecutive reports) emits ``straggler`` about itself
  (rank, score, section) at each report and, when newly named, prints one ``STRAGGLER`` line;
* with ``restart``, once a rank is named every rank raises :class:`StragglerDetected` at the same
  step (an in-process restart, no rank left waiting in a collective), and
  :meth:`StragglerHooks.health_check` makes the straggler leave at that restart.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from nvrx_lab.train.hooks import Attempt, Hooks

from .config import ACTIONS, StragglerConfig
from .detector import Detector
from .scores import THRESHOLD, Report
from .timers import ComputeTimer


class StragglerDetected(RuntimeError):
    """Raised on every rank when a persistent straggler is found (``--straggler-action restart``)."""


class StragglerError(RuntimeError):
    """The straggler's health check: it leaves the job at the restart."""


class StragglerHooks(Hooks):
    """Times compute, scores every ``interval`` steps, reports (and acts on) stragglers."""

    def __init__(self, interval: int = 10, threshold: float = THRESHOLD, action: str = "report",
                 emit: Callable[..., None] | None = None, device: torch.device | None = None, patience: int = 2,
                 clock: str = "cpu"):
        if action not in ACTIONS:
            raise ValueError(f"straggler action {action!r} is not one of {', '.join(ACTIONS)}")
        self.interval, self.threshold, self.action, self.patience = interval, threshold, action, patience
        self.emit = emit or (lambda kind, **fields: None)
        self.timer = ComputeTimer(device, clock)
        self.detector: Detector | None = None
        self.rank = 0
        self.unhealthy = ""
        """Why this rank must leave at the next restart; empty: healthy."""
        self.overhead_s = 0.0
        """Seconds this rank spent reporting (gathering, scoring, emitting)."""
        self.warm = False
        """Whether this attempt's first step is over (it is not timed: see :meth:`after_step`)."""

    @classmethod
    def from_config(cls, config: StragglerConfig, emit: Callable[..., None] | None = None,
                    device: torch.device | None = None) -> StragglerHooks:
        return cls(config.interval, config.threshold, config.action, emit=emit, device=device)

    def start(self, attempt: Attempt | None = None) -> None:
        """Each attempt: a fresh detector on the attempt's CPU group (ranks and world size may have changed);
        without an attempt (a single process, a test), this process alone."""
        self.rank = attempt.rank if attempt is not None else 0
        group = attempt.cpu_group if attempt is not None and dist.is_initialized() else None
        self.detector = Detector(self.interval, self.threshold, group, patience=self.patience)
        self.timer.discard()
        self.timer.install()
        self.warm = False

    def after_step(self, step: int) -> None:
        if self.warm:
            self.timer.end_step()
        else:  # the attempt's first step (optimizer state, cold caches) takes 8-15x a later one here: it is
            self.timer.discard()  # not the rank's speed, and it would weigh on its interval's mean
            self.warm = True
        if self.detector is None or not self.detector.due(step):
            return
        t0 = time.perf_counter()
        self.detector.record(self.timer.times())
        report = self.detector.report(step)
        self.publish(report)
        self.overhead_s += time.perf_counter() - t0
        if self.action == "restart" and report.stragglers:
            self.act(report)

    def publish(self, report: Report) -> None:
        if self.rank == 0:
            self.emit("straggler_scores", step=report.step, relative=report.by_section(report.relative),
                      individual=report.by_section(report.individual), overhead_s=round(self.overhead_s, 6),
                      mean_ms={s: [round(m.get(s, 0.0) * 1e3, 4) for m in report.times] for s in report.times[0]})
        for s in report.stragglers:
            if s.rank != self.rank:
                continue
            strikes = self.detector.strikes.get(s.rank, 0)
            self.emit("straggler", rank=s.rank, step=report.step, score=round(s.score, 4), section=s.section,
                      individual=round(s.individual, 4), strikes=strikes, threshold=self.threshold,
                      sections={k: round(v, 4) for k, v in report.relative[s.rank].items()})
            if strikes == self.patience:
                print(f"[rank {self.rank}] STRAGGLER rank {s.rank} at step {report.step}: computes at {s.score:.2f} "
                      f"of the fastest rank's speed (threshold {self.threshold:g}, {strikes} reports in a row; "
                      f"slowest section {s.section} {report.relative[s.rank][s.section]:.2f}), {s.individual:.2f} of "
                      "its own best", file=sys.stderr, flush=True)

    def act(self, report: Report) -> None:
        """``restart``: every rank raises at this step; the straggler is unhealthy at the restart."""
        why = "; ".join(f"rank {s.rank} compute score {s.score:.2f} < {self.threshold:g} in "
                        f"{self.detector.strikes[s.rank]} consecutive reports" for s in report.stragglers)
        if self.rank in {s.rank for s in report.stragglers}:
            self.unhealthy = f"persistent straggler ({why})"
        raise StragglerDetected(f"persistent straggler at step {report.step}: {why}")

    def health_check(self, state):
        """For the in-process wrapper (``health_check=``): a persistent straggler leaves the job."""
        if self.unhealthy:
            raise StragglerError(f"rank {self.rank} is a {self.unhealthy}")
        return state

    def close(self) -> None:
        self.timer.remove()
