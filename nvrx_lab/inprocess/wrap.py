"""``Wrapper``: restart a failed or hung function inside the same processes
==========================================================================

Decorate the training function; it receives a :class:`~.call_wrapper.CallWrapper` as its first
argument and is re-entered with ``iteration + 1`` after any fault on any rank::

    from nvrx_lab.inprocess import Wrapper, CallWrapper

    @Wrapper(soft_timeout=60.0, hard_timeout=90.0, max_iterations=10)
    def train(call_wrapper: CallWrapper):
        call_wrapper.init_process_group(backend="gloo")
        ...

Launch as usual (``torchrun --nproc-per-node 2 train.py``): the wrapper reads ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and meets its peers in its own store at
``MASTER_PORT + 1``. Notebook ``notebooks/02_in_process_restart.ipynb`` builds it step by step.

Faults and what handles them: an exception (reported to the store, every rank interrupted),
a hang (no ``ping`` for ``soft_timeout``: interrupted even in ``time.sleep`` or a blocked read),
a frozen rank (killed by its monitor process after ``hard_timeout``), a dead rank (death notice
from its monitor process, or ``heartbeat_timeout``). Note: ``torchrun`` stops every worker when
one process dies, so the last two only restart *in process* under a launcher that lets the
survivors run (``nvrx_lab.inprocess.spawn``, or the in-job launcher's ``min-healthy`` policy).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from .abort import AbortTorchDistributed, prepare_dump
from .call_wrapper import GroupSettings
from .compose import Compose
from .interrupt import SocketTracker
from .launch import Launch
from .loop import RestartLoop
from .monitor import ThreadSettings
from .monitor_process import ProcessSettings
from .rank_assignment import RankAssignment, ShiftRanks


def _seconds(name: str, value, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Wrapper.{name} must be seconds (float) or a timedelta, got {value!r}") from None
    if value <= 0:
        raise ValueError(f"Wrapper.{name} must be > 0 s, got {value}")
    return value


@dataclass
class Wrapper:
    """In-process restart of the decorated function (configuration + decorator)."""

    soft_timeout: float | timedelta = 60.0
    """No ``ping()`` for this long (s) on a rank: its attempt is interrupted and every rank restarts."""
    hard_timeout: float | timedelta | None = 90.0
    """No progress for this long (s): the monitor process SIGKILLs the rank; the others go on.
    ``None`` disables the kill. Must exceed ``soft_timeout``."""
    max_iterations: int | None = 10
    """At most this many attempts (first call included); then :class:`RestartLimitError`."""
    min_world_size: int = 1
    """Fewer live active ranks than this after a restart: :class:`RestartLimitError`."""
    store_host: str | None = None
    """Host of the wrapper's store; default ``MASTER_ADDR``."""
    store_port: int | None = None
    """Port of the wrapper's store; default ``MASTER_PORT + 1``."""
    host_store: bool = True
    """Rank 0's monitor process hosts the store; ``False`` if something else serves it."""
    heartbeat_interval: float = 0.5
    """Seconds between a rank's heartbeats in the store."""
    heartbeat_timeout: float = 5.0
    """A peer whose heartbeat has not moved for this long (s) is dead (fallback when its monitor
    process died with it; a plain SIGKILL is noticed by the death notice much sooner)."""
    monitor_interval: float = 0.01
    """Poll period (s) of the monitor thread (fault watch); the monitor process polls at twice it."""
    barrier_timeout: float = 120.0
    """Bound (s) on every wait in the store: rendezvous, completion."""
    pg_timeout: float = 300.0
    """Default collective timeout (s) for ``call_wrapper.init_process_group``. For a group with an
    NCCL part it must exceed ``hard_timeout`` (``soft_timeout`` without one): NCCL's watchdog ends
    the whole process when a collective times out, before any in-process restart. A short value
    is fine for gloo (its sockets are cut on an abort anyway)."""
    rank_assignment: RankAssignment = field(default_factory=ShiftRanks)
    """Maps survivors to new ranks: :class:`ShiftRanks` or :class:`FillGaps` (with ``spares``)."""
    health_check: Callable | None = None
    """``check(state)`` run after every abort; raising makes this rank leave (see health_check.py).
    On GPUs pass ``default_health_check(device)``: a poisoned CUDA context then leaves at once
    instead of failing every attempt up to ``max_iterations``."""
    abort: Callable = field(default_factory=AbortTorchDistributed)
    """``abort(state)`` run by the monitor thread to unblock collectives (see abort.py)."""
    emit: Callable | None = None
    """Event sink ``emit(kind, **fields)``, e.g. ``nvrx_lab.observe.events.EventLog(path, rank).emit``."""

    def __post_init__(self):
        self.soft_timeout = _seconds("soft_timeout", self.soft_timeout)
        self.hard_timeout = _seconds("hard_timeout", self.hard_timeout, allow_none=True)
        if self.hard_timeout is not None and self.hard_timeout <= self.soft_timeout:
            raise ValueError(f"Wrapper.hard_timeout ({self.hard_timeout} s) must exceed soft_timeout "
                             f"({self.soft_timeout} s): the soft interrupt comes first")
        for name in ("heartbeat_interval", "heartbeat_timeout", "monitor_interval", "barrier_timeout", "pg_timeout"):
            setattr(self, name, _seconds(name, getattr(self, name)))
        if self.max_iterations is not None and self.max_iterations < 1:
            raise ValueError(f"Wrapper.max_iterations must be >= 1 or None, got {self.max_iterations}")
        if self.min_world_size < 1:
            raise ValueError(f"Wrapper.min_world_size must be >= 1, got {self.min_world_size}")
        if not isinstance(self.rank_assignment, RankAssignment):
            raise ValueError(f"Wrapper.rank_assignment must be ShiftRanks(...) or FillGaps(...), "
                             f"got {self.rank_assignment!r}")
        if self.store_port is not None and not 0 < int(self.store_port) < 65536:
            raise ValueError(f"Wrapper.store_port must be a TCP port (1..65535), got {self.store_port}")

    @property
    def gloo_max_timeout(self) -> float | None:
        """The gloo part's collective timeout is capped here: a tenth (at least 1 s) under ``hard_timeout``.
        gloo leaves a send that was queued on a pair when the pair fails (its sockets cut by an abort) waiting
        until this timeout: ``Pair::signalException`` wakes bound buffers in the send queue, not unbound ones.
        At 16 ranks here that kept a rank in its collective after 2 of 10 aborts, and the monitor process
        killed it at the hard timeout. Capped, it raises first and rejoins. ``None`` without a hard timeout."""
        if self.hard_timeout is None:
            return None
        return self.hard_timeout - max(1.0, 0.1 * self.hard_timeout)

    @property
    def nccl_min_timeout(self) -> float:
        """An NCCL group's collective timeout must exceed this (see ``pg_timeout``)."""
        return self.hard_timeout if self.hard_timeout is not None else self.soft_timeout

    # -- what each component gets of these settings (one place for each translation) -----------------
    def process_settings(self, launch: Launch) -> ProcessSettings:
        """The monitor process's settings: it polls at twice the thread's period; rank 0's hosts the store."""
        host, port = launch.store_address(self.store_host, self.store_port)
        return ProcessSettings(
            launch.rank, launch.world_size, host, port, host_store=launch.rank == 0 and self.host_store,
            hard_timeout=self.hard_timeout if self.hard_timeout is not None else math.inf,
            interval=self.monitor_interval * 2, heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout, policy=self.rank_assignment,
            idle_exit=max(10.0, 3 * self.heartbeat_timeout))

    def thread_settings(self) -> ThreadSettings:
        """The monitor thread's settings."""
        return ThreadSettings(self.soft_timeout, self.heartbeat_interval, self.monitor_interval)

    def group_settings(self, launch: Launch) -> GroupSettings:
        """What ``call_wrapper.init_process_group`` needs: the timeouts, and gloo's transport from the launch."""
        return GroupSettings(self.pg_timeout, self.nccl_min_timeout, self.gloo_max_timeout,
                             launch.gloo_transport, len(launch.gloo_interfaces))

    def bind_abort(self, sockets: SocketTracker, dump_to: str | None = None) -> Callable:
        """Give every :class:`AbortTorchDistributed` in ``abort`` the attempt's socket tracker and where its flight
        recorder dump goes (then what the dump needs is imported now, not in the first abort: :func:`.abort.prepare_dump`)."""
        policies = self.abort.policies if isinstance(self.abort, Compose) else (self.abort,)
        for p in policies:
            if isinstance(p, AbortTorchDistributed):
                p.sockets, p.dump_to = sockets, dump_to
                if dump_to is not None:
                    prepare_dump()
        return self.abort

    def dumped(self) -> dict | None:
        """The last flight-recorder dump an abort took (see :meth:`bind_abort`), then forgotten."""
        policies = self.abort.policies if isinstance(self.abort, Compose) else (self.abort,)
        for p in policies:
            if isinstance(p, AbortTorchDistributed) and p.dumped is not None:
                out, p.dumped = p.dumped, None
                return out
        return None

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            return RestartLoop(self, fn).run(args, kwargs)

        return wrapped
