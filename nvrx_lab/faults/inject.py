"""The one injector: fires this rank's scheduled faults at their step and phase, in the attempts they name.

::

    injector = FaultInjector(parse_schedule("1:12:sigkill"), rank, attempt=0, state_file=..., emit=events.emit)
    injector(step)                      # before each step
    injector.during("save", step)       # inside checkpoint I/O (the trainer's save and load phases)

A fault without ATTEMPTS fires once: it is appended to ``state_file`` (one fsynced JSON line) *before* it acts,
so the step a restart redoes does not fire it again, in this process or the one a launcher starts in its place.
What a kind does is :func:`inject`; a caller may take over a kind with ``actions`` (a demo worker runs ``pause``
inside a heartbeat section, say), never add one: the vocabulary is :data:`nvrx_lab.faults.KINDS`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .schedule import Fault, InjectedFault, fired_faults


def _signals_blocked_forever(seconds: float) -> None:
    """A hang no signal reaches: every catchable signal blocked for this thread, then sleep."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP})
    time.sleep(seconds)


def _blocked_recv() -> None:
    a, b = socket.socketpair()
    try:
        a.recv(1)
    finally:
        a.close()
        b.close()


def _kill_children_then_self() -> None:
    import psutil

    for child in psutil.Process().children():
        os.kill(child.pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def inject(fault: Fault, rank: int, hang_s: float = 3600.0, oom_bytes: int = 64 << 20) -> None:
    """Do what ``fault`` says, here and now (see :data:`nvrx_lab.faults.KINDS`)."""
    if fault.kind == "exception":
        raise InjectedFault(f"injected exception on rank {rank} at step {fault.step}")
    if fault.kind == "hang":
        time.sleep(hang_s)
    elif fault.kind == "hang_socket":
        _blocked_recv()
    elif fault.kind == "hang_native":
        _signals_blocked_forever(hang_s)
    elif fault.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "sigkill_all":
        _kill_children_then_self()
    elif fault.kind == "exit":
        sys.exit(int(fault.value))
    elif fault.kind == "oom":
        hog = bytearray(oom_bytes)  # touch real memory before failing, as an allocator would
        del hog
        raise MemoryError(f"injected memory exhaustion on rank {rank} at step {fault.step}")
    elif fault.kind == "hang_spin":
        from .slowdown import spin

        spin(hang_s)  # a hang that keeps a core busy, as a synchronize on a hung GPU does
    elif fault.kind in ("slow", "slow_sleep"):
        from .slowdown import slow_down

        slow_down(fault.value, sleep=fault.kind == "slow_sleep")
    elif fault.kind == "pause":
        time.sleep(fault.value)
    else:
        raise ValueError(f"unknown fault kind {fault.kind!r}")


class FaultInjector:
    """Call with the step about to run (or ``during(phase, step)`` for a save or a load); fires this rank's
    faults for that step and phase: once each, or in each attempt they name."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int = 0, state_file: str | os.PathLike | None = None,
                 emit: Callable[..., None] | None = None, hang_s: float = 3600.0,
                 actions: dict[str, Callable[[Fault], None]] | None = None):
        self.faults = [f for f in faults if f.hits(rank)]
        self.rank, self.attempt, self.emit, self.hang_s = rank, attempt, emit, hang_s
        self.state_file = Path(state_file) if state_file else None
        self.actions = actions or {}
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
                os.write(fd, (json.dumps({"id": fault.id, "t": t, "kind": fault.kind, "rank": self.rank,
                                          "step": fault.step}) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        return t

    def due(self, phase: str, step: int) -> list[Fault]:
        """This rank's faults for ``step`` and ``phase`` in this attempt, not fired yet if they fire once."""
        now = [f for f in self.faults if f.step == step and f.phase == phase and f.fires_in(self.attempt)]
        once = {f.id for f in now if f.attempts is None}
        fired = self.fired() if once else set()
        return [f for f in now if f.attempts is not None or f.id not in fired]

    def __call__(self, step: int) -> None:
        self.during("step", step)

    def catch_up(self, step: int) -> None:
        """Fire the step faults of ``step`` and of the steps before it that this rank never ran (once each): a
        replica that joins at a later step than its predecessor reached fires what it skipped, so a schedule fires
        the same faults however long a replacement took to start."""
        fired = self.fired()
        for fault in [f for f in self.faults if f.phase == "step" and f.step <= step and f.attempts is None]:
            if fault.id not in fired:
                self.fire(fault, "step", step)

    def during(self, phase: str, step: int) -> None:
        for fault in self.due(phase, step):
            self.fire(fault, phase, step)

    def fire(self, fault: Fault, phase: str, step: int) -> None:
        t = self._record(fault)
        if self.emit:
            self.emit("fault", t=t, step=step, fault=fault.kind, target=self.rank, phase=phase, attempt=self.attempt,
                      **({"factor": fault.value} if fault.factor else {}))
        where = f"step {step}" if phase == "step" else f"the {phase} of step {step}"
        print(f"[rank {self.rank}] FAULT injected: {fault.kind} in {where} ({fault.id})", file=sys.stderr, flush=True)
        action = self.actions.get(fault.kind)
        if action is not None:
            action(fault)
        else:
            inject(fault, self.rank, self.hang_s)
