"""What every (re)start of training says: where it resumed from, how far it rolled back, and how long
after the fault it trained again — one console line, one ``recovered`` event.

Three facts make the line, each read where it lives:

* **the step reached** before the fault: rank 0 writes it after every step into a small file beside the
  checkpoints (:class:`ProgressMarker`, one ``pwrite`` of a fixed-width line: it survives the process),
  with the moment its attempt began training;
* **the fault**: the injected ones fired since that moment, from the fired-faults file
  (:func:`nvrx_lab.faults.fired_faults`; a fault's moment is its ``fault`` event's ``t``), the first of which
  stopped training; else what the restart layer saw (:class:`Recovering`: the in-process wrapper's restart
  record, the launcher's failure notice);
* **the restore**: the step and the copy each rank restored from (``memory``, ``local``, ``peer``, ``storage``).

The line comes once the first step after a fault is done, and its recovery figure is the one
:mod:`nvrx_lab.observe.goodput` computes from the event stream: fault → the start of that step. A start that
recovers from no fault (a new run, a relaunch of a stopped one) says so before its first step::

    [nvrx_lab] RESUME step 10 from storage (rolled back 1 step, step 11 was reached); training again 0.31 s
               after the fault (exception on rank 1 in step 12)
    [nvrx_lab] START step 0 of 40: a new run (nothing committed in build/ckpt yet)
    [nvrx_lab] RESUME step 20 from storage: continuing the run in build/ckpt (relaunched; rolled back 3 steps)
    [nvrx_lab] DONE step 40 already committed in build/ckpt: nothing to train (--fresh starts a new run there)
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from nvrx_lab.checkpoint import Checkpointer, Restored
from nvrx_lab.faults import fired_faults
from nvrx_lab.net import wait_for
from nvrx_lab.train import runs
from nvrx_lab.train.hooks import Attempt, Hooks, Recovering

if TYPE_CHECKING:
    from nvrx_lab.train.config import TrainConfig
    from nvrx_lab.train.state import TrainState


@dataclass(frozen=True)
class Reached:
    step: int
    t: float
    """Wall-clock moment rank 0 finished that step."""
    started: float
    """Wall-clock moment the attempt that reached it began its first step."""


class ProgressMarker:
    """Rank 0's newest finished step, its moment and its attempt's start, in one fixed-width line rewritten
    in place (a ``pwrite`` a step: no fsync, a process killed keeps it, only a lost node loses it)."""

    WIDTH = 64

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.started: float | None = None

    def write(self, step: int, t: float, began: float) -> None:
        """Step ``step`` done at ``t``; it began at ``began`` (the first such moment is the attempt's start)."""
        self.started = began if self.started is None else self.started
        line = f"{step:d} {t:.6f} {self.started:.6f}"
        os.pwrite(self._fd, line.ljust(self.WIDTH - 1).encode() + b"\n", 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def read(path: Path | None) -> Reached | None:
        try:
            step, t, started = Path(path).read_text().split()[:3]
            return Reached(int(step), float(t), float(started))
        except (OSError, TypeError, ValueError):
            return None


@dataclass
class Start:
    """One (re)start of training on rank 0: what it says, and when (:meth:`before_training`, :meth:`after_first_step`)."""

    steps: int
    where: str
    """The checkpoint folder, for the lines (empty: no checkpoints)."""
    resumed: int | None
    """The step restored (None: nothing was)."""
    sources: dict[str, int]
    """Copy restored from -> ranks that restored from it."""
    reached: Reached | None
    faults: list[dict]
    """The faults recovered from (oldest first): ``t``, ``kind``, ``rank``, ``step`` (may lack the last two)."""
    first_start: bool
    """The first attempt of this launch (a later one without a known fault was restarted for an unknown one)."""

    @property
    def step(self) -> int:
        return self.resumed or 0

    @property
    def rollback(self) -> int:
        return max(0, self.reached.step - self.step) if self.reached else 0

    def _restored(self) -> str:
        if self.resumed is None:
            why = f"nothing committed in {self.where} yet" if self.where else "no checkpoints (--ckpt none)"
            return f"step 0 ({why})"
        src = ", ".join(s + (f" on {n} rank{'s' if n > 1 else ''}" if len(self.sources) > 1 else "")
                        for s, n in self.sources.items())
        return f"step {self.resumed} from {src or 'storage'}"

    def _rolled(self) -> str:
        return f"rolled back {self.rollback} step{'s' if self.rollback != 1 else ''}, step {self.reached.step} was reached"

    def before_training(self) -> str | None:
        """The line of a start that recovers from no fault (said at once), or None (said after the first step)."""
        if self.faults:
            return None
        if self.resumed is not None and self.resumed >= self.steps:
            return done_line(self.resumed, self.where)
        if self.first_start and self.resumed is None and not self.rollback:
            return f"START step 0 of {self.steps}: a new run ({self._restored().removeprefix('step 0 (')}"
        how = "continuing the run" + (f" in {self.where}" if self.where else "")
        rolled = f"; {self._rolled()}" if self.reached else ""
        why = "relaunched" if self.first_start else "restarted; the restart layer reported no fault time"
        return f"RESUME {self._restored()}: {how} ({why}{rolled})"

    def after_first_step(self, step_start_t: float) -> tuple[str, dict] | None:
        """The line and ``recovered`` event fields of a start that recovers from a fault, once its first
        step (which began at ``step_start_t``) is done; None without a fault."""
        if not self.faults:
            return None
        first = self.faults[0]
        recovery = step_start_t - first["t"]
        what = first.get("kind", "fault")
        at = f" in step {first['step']}" if first.get("step") is not None else ""
        more = f", and {len(self.faults) - 1} more since" if len(self.faults) > 1 else ""
        rolled = f" ({self._rolled()})" if self.reached else ""
        line = (f"RESUME {self._restored()}{rolled}; training again {recovery:.2f} s after the fault "
                f"({what} on rank {first.get('rank', '?')}{at}{more})")
        fields = {"recovery_s": recovery, "fault_t": first["t"], "fault": what, "target": first.get("rank"),
                  "resumed": self.resumed, "rollback_steps": self.rollback, "sources": self.sources,
                  "faults": len(self.faults)}
        return line, fields


def faults_since(state_file: Path | None, reached: Reached | None, seen: Recovering | None) -> list[dict]:
    """The faults this start recovers from: the injected ones fired since the previous attempt began training
    (the first of them stopped it), else the one the restart layer saw."""
    after = reached.started if reached else 0.0
    injected = [f for f in fired_faults(state_file) if f.get("t", 0) > after and f.get("kind") != "slow"]
    if injected:
        return sorted(injected, key=lambda f: f["t"])
    if seen is not None and seen.t > after:
        return [{"t": seen.t, "kind": seen.cause, "rank": seen.rank}]
    return []


def count_sources(sources: list[str | None]) -> dict[str, int]:
    """``["local", "peer", "local"]`` -> ``{"local": 2, "peer": 1}`` (None: a rank restored nothing)."""
    return dict(Counter(s for s in sources if s is not None))


PREFIX = "[nvrx_lab]"


def resume(state: TrainState, checkpointer: Checkpointer, attempt: Attempt, hooks: Hooks) -> Restored | None:
    """Load the newest checkpoint, from the nearest copy that has it, into ``state``; None if there is none."""
    t0 = time.perf_counter()
    restored = checkpointer.restore(state, hooks)
    if restored is None:
        return None
    load_s = time.perf_counter() - t0
    attempt.events.emit("resume", step=state.step, load_s=load_s, world_size=attempt.world_size,
                        source=restored.source, rollback_steps=restored.rollback_steps)
    hooks.on_resume(load_s)
    hooks.progress()
    return restored


def starting(cfg: TrainConfig, attempt: Attempt, restored: Restored | None) -> Start | None:
    """What this start of training says (rank 0; collective: every rank's restore source is gathered)."""
    sources = [restored.source if restored is not None else None]
    if dist.is_initialized() and attempt.world_size > 1:
        gathered: list = [None] * attempt.world_size
        dist.all_gather_object(gathered, sources[0], group=attempt.cpu_group)
        sources = gathered
    if attempt.rank != 0:
        return None
    reached = ProgressMarker.read(runs.progress_file(cfg))
    faults = faults_since(runs.fault_state_file(cfg), reached, attempt.recovering)
    folder = runs.ckpt_dir(cfg)
    return Start(cfg.steps, str(folder) if folder else "", restored.step if restored else None,
                 count_sources(sources), reached, faults, attempt.first_start)


def start_line(attempt: Attempt, hooks: Hooks, poll_s: float = 0.002) -> None:
    """Every rank starts the first step together, and waiting here for the others is progress. Loading a
    checkpoint or starting the writer takes longer on some ranks; a rank done first would otherwise wait in
    the first step's collective with nothing to say it is well, and its soft timeout would call a slow
    peer's load its own hang. A rank that truly hangs meanwhile is reported by its own monitor. Polled every 2 ms:
    the start line is on every restart's path (a 50 ms poll was the largest phase of an in-process restart)."""
    if not dist.is_initialized() or attempt.world_size == 1:
        return
    work = dist.barrier(group=attempt.cpu_group, async_op=True)
    wait_for(work.is_completed, float("inf"), "every rank at the start line", interval=poll_s, on_poll=hooks.progress)
    work.wait()  # raises if the group was aborted meanwhile


def done_line(step: int, where: str) -> str:
    """What a launch onto a finished run says (and nothing more: it trains nothing)."""
    return (f"DONE step {step} already committed in {where}: nothing to train (--fresh starts a new run there, or pass "
            "more --steps)")
