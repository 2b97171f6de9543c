"""``CallWrapper``: what the wrapped function sees of the in-process restart machinery
====================================================================================

Passed as the first argument of the wrapped function, one per attempt::

    def train(call_wrapper: CallWrapper):
        call_wrapper.init_process_group(backend="gloo")   # right ranks, fresh store prefix
        step = load_latest(...)                            # then call_wrapper.record("reload_s", s)
        while step < steps:
            ...; call_wrapper.ping()                       # progress, once a step
            with call_wrapper.atomic(): save(...)          # a restart never cuts this
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch.distributed as dist

from .interrupt import RankShouldRestart, SocketTracker
from .monitor import MonitorThread
from .monitor_process import Progress
from .state import State


class CallWrapper:
    def __init__(self, state: State, client: dist.Store, client_fds: set[int], monitor: MonitorThread,
                 sockets: SocketTracker, progress: Progress | None, pg_timeout: float,
                 on_first_ping=None):
        self.state = state
        self._client, self._client_fds = client, client_fds
        self._monitor, self._sockets, self._progress = monitor, sockets, progress
        self._pg_timeout = pg_timeout
        self._on_first_ping = on_first_ping
        self.records: dict[str, float] = {}
        """Values the function reported with :meth:`record` (``reload_s`` goes into the restart log)."""

    # -- identity ------------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        """0 for the first attempt, +1 per restart."""
        return self.state.iteration

    @property
    def rank(self) -> int | None:
        """Rank in this attempt (contiguous ``0..world_size-1``); ``None`` for a spare."""
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def initial_rank(self) -> int:
        """``RANK`` at launch; stable across restarts (use it to address fault schedules, logs)."""
        return self.state.initial_rank

    @property
    def store(self) -> dist.Store:
        """A store for the function's own keys, namespaced to this attempt (``it/<n>/user/``)."""
        return dist.PrefixStore(f"it/{self.iteration}/user", self._client)

    # -- process group -------------------------------------------------------------------------
    def init_process_group(self, backend: str = "gloo", timeout: float | timedelta | None = None,
                           **kwargs) -> None:
        """``torch.distributed.init_process_group`` for this attempt: this attempt's rank and
        world size, a fresh store prefix ``it/<n>/pg``, and sockets tracked so an abort can cut
        them. Extra ``kwargs`` go to torch (e.g. ``device_id`` for NCCL)."""
        if self.rank is None:
            raise RuntimeError("a spare rank has no process group (call_wrapper.rank is None)")
        if dist.is_initialized():
            raise RuntimeError("a default process group already exists; create it only via call_wrapper")
        if timeout is None:
            timeout = self._pg_timeout
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        pg_store = dist.PrefixStore(f"it/{self.iteration}/pg", self._client)
        self._sockets.begin(init_only=self._client_fds)
        try:
            dist.init_process_group(backend, store=pg_store, rank=self.rank, world_size=self.world_size,
                                    timeout=timeout, **kwargs)
        finally:
            self._sockets.commit()
        self._touch()

    # -- progress ------------------------------------------------------------------------------
    def ping(self) -> None:
        """Progress signal (once a step): resets the soft and hard timeouts."""
        self._touch()
        if self._on_first_ping is not None:
            cb, self._on_first_ping = self._on_first_ping, None
            cb(self)

    def _touch(self) -> None:
        self._monitor.last_ping = time.monotonic()
        if self._progress is not None:
            self._progress.write()

    def record(self, name: str, value: float) -> None:
        """Report a measurement of this attempt, e.g. ``record("reload_s", 0.8)`` after loading."""
        self.records[name] = float(value)
        self._touch()

    @contextlib.contextmanager
    def atomic(self):
        """A section a restart must not cut (e.g. the last write of a checkpoint): the monitor
        waits for it to end before it aborts; once an interrupt has begun, entering raises. A slow
        section is no hang: the soft timeout is suspended inside it (the hard timeout is not)."""
        with self._monitor.atomic_lock:
            if self._monitor.interrupting:
                raise RankShouldRestart("attempt is being interrupted; atomic section not entered")
            self._monitor.atomic_depth += 1
            try:
                yield
            finally:
                self._monitor.atomic_depth -= 1
                self._touch()  # the soft timeout, suspended inside, counts from the section's end

