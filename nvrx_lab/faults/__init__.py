"""Deterministic fault injection: one vocabulary, one grammar, one injector for the trainer and every demo worker.

A schedule is comma-separated entries ``RANK[:ATTEMPTS]:STEP:KIND[:ARG]``, e.g. ``1:12:sigkill,1:25:hang``,
parsed by :func:`parse_schedule` (the trainer's ``--faults``, ``JobSpec.faults``, the benchmarks and the demo
workers all read it here), or drawn from a seed by :func:`make_schedule`:

* ``RANK``     — the (initial) rank that injects it, or ``*`` for every rank;
* ``ATTEMPTS`` — the restart attempts in which it fires: ``N``, ``A-B`` or ``*``. Without it a fault fires
  once, and is remembered across restarts (in a state file beside the checkpoints when there is one);
* ``STEP``     — the step it fires at;
* ``KIND``     — what happens, one of :data:`KINDS`;
* ``ARG``      — a ``PHASE`` (where in that step, below) for most kinds; a number for ``slow`` and ``slow_sleep`` (FACTOR > 1),
  ``pause`` (SECONDS) and ``exit`` (CODE).

Kinds (:data:`KINDS`; :func:`inject` does them):

* ``exception``   — raise :class:`InjectedFault` (a Python error in the training step);
* ``hang``        — sleep far past any timeout (a rank stuck in Python-level blocking code; a signal reaches it);
* ``hang_socket`` — a blocked ``recv`` (a rank stuck in a C call);
* ``hang_native`` — a hang no signal can reach (every catchable signal blocked): only a kill ends it;
* ``hang_spin``   — a hang that keeps a core busy (a thread spinning in a synchronize on a hung GPU);
* ``sigkill``     — ``SIGKILL`` to the own process (a crash that takes the interpreter);
* ``sigkill_all`` — ``SIGKILL`` to the own children first (a monitor process), then itself: a lost node;
* ``exit``        — ``sys.exit(CODE)`` (2 reads as a usage error: no launcher retries it);
* ``oom``         — allocate, then raise ``MemoryError`` (a stand-in for an out-of-memory error);
* ``slow``        — the rank computes ``FACTOR``× slower from that step on (:mod:`.slowdown`): a straggler,
  alive and slow, which only :mod:`nvrx_lab.straggler` notices (no failure: it fires before its step);
* ``slow_sleep``  — as ``slow``, but the rank's thread sleeps through the extra time (the host waiting on a GPU that
  computes slowly, or on autograd's device threads): slow, and idle on the CPU;
* ``pause``       — a legitimate long phase of ``SECONDS`` (a checkpoint, an evaluation), no fault: what must
  *not* be taken for a hang (``*:0:3:pause:5`` pauses every rank).

Phases: ``step`` (default: before training step ``STEP``), ``save`` (right after the save of step ``STEP`` was
handed over), ``load`` (while the checkpoint of step ``STEP`` is loaded: read, not yet applied).

The injector (:class:`~.inject.FaultInjector`) emits one ``fault`` event per fault (``t``, ``step``, ``fault``:
the kind, ``target``, ``phase``, ``attempt``) and prints one ``FAULT injected`` line before it acts; the fired
faults are appended to ``state_file`` (:func:`fired_faults`) *before* they act.
"""

from .inject import FaultInjector, inject
from .schedule import (
                       EVERY_RANK,
                       KINDS,
                       PHASES,
                       Fault,
                       FaultConfig,
                       InjectedFault,
                       fired_faults,
                       format_schedule,
                       make_schedule,
                       parse_schedule,
)

__all__ = ["EVERY_RANK", "Fault", "FaultConfig", "FaultInjector", "InjectedFault", "KINDS", "PHASES", "fired_faults",
           "format_schedule", "inject", "make_schedule", "parse_schedule"]
