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
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .interrupt import RankShouldRestart, SocketTracker
from .monitor import MonitorThread
from .monitor_process import Progress
from .state import State


class ConfigError(ValueError):
    """A setting that cannot work on any attempt: raised at once, never retried."""


def cap_gloo_timeout(timeout: float, cap: float | None) -> None:
    """Lower the default group's gloo collective timeout to ``cap`` (see ``Wrapper.gloo_max_timeout``)."""
    if cap is None or timeout <= cap:
        return
    try:
        gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
    except Exception:  # no CPU backend in this group
        return
    if type(gloo).__name__ == "ProcessGroupGloo":  # torch's backend object: only gloo's timeout is capped
        gloo._set_default_timeout(timedelta(seconds=cap))


def gloo_sockets(backend: str | None, world_size: int, transport: str = "TCP", interfaces: int = 1) -> int:
    """Connected TCP sockets a gloo group keeps on each rank: one per peer and device (``GLOO_SOCKET_IFNAME``
    may list several ``interfaces``, a device each); 0 without gloo, or with a ``transport`` other than TCP."""
    if backend is not None and "gloo" not in str(backend).lower():
        return 0
    if not transport.upper().startswith("TCP"):
        return 0
    return (world_size - 1) * max(1, interfaces)


def uses_nccl(backend, device_id) -> bool:
    """Whether ``init_process_group(backend, device_id=...)`` would give the group an NCCL part."""
    if backend is None:
        return device_id is not None and torch.device(device_id).type == "cuda"
    return "nccl" in str(backend).lower()


def check_nccl_timeout(timeout_s: float, min_s: float | None) -> None:
    """NCCL's watchdog acts once a collective outlives the group's timeout: it ends the whole process
    (torch 2.13's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, torchrun sets 1) or aborts the
    communicators on every rank (2). Either must come after the in-process restart had its say,
    whose last resort (the hard timeout) kills only the hung rank."""
    if min_s is not None and timeout_s <= min_s:
        raise ConfigError(
            f"the NCCL collective timeout ({timeout_s:g} s) must exceed the Wrapper's hard_timeout "
            f"(or soft_timeout when there is none: {min_s:g} s); NCCL's watchdog would otherwise act "
            f"(end the process, by default) before the in-process restart does. Set Wrapper(pg_timeout=...) or pass "
            f"timeout=... to call_wrapper.init_process_group, e.g. {min_s + 60:g} s")


def connect_device(pg: dist.ProcessGroup, device: torch.device) -> None:
    """Bind ``pg`` to ``device`` and connect its accelerator backend now (what torch does inside
    ``init_process_group(device_id=...)``: NCCL's communicator is created eagerly, and later
    ``new_group`` calls split it)."""
    pg.bound_device_id = device
    backend = pg._get_backend(device)
    if backend.supports_splitting:
        backend.eager_connect_single_device(device)


@dataclass(frozen=True)
class GroupSettings:
    """How :meth:`CallWrapper.init_process_group` makes an attempt's group (built by
    :meth:`.wrap.Wrapper.group_settings`)."""

    pg_timeout: float = 300.0
    """Default collective timeout (s) of the group (``Wrapper.pg_timeout``)."""
    nccl_min_timeout: float | None = None
    """An NCCL part's timeout must exceed this (s); ``None``: not checked (``Wrapper.nccl_min_timeout``)."""
    gloo_max_timeout: float | None = None
    """The gloo part's timeout is capped here (s); ``None``: not capped (``Wrapper.gloo_max_timeout``)."""
    gloo_transport: str = "TCP"
    """gloo's transport (``GLOO_DEVICE_TRANSPORT`` at launch): only TCP's sockets are awaited."""
    gloo_interfaces: int = 1
    """Network interfaces gloo connects each pair over (``GLOO_SOCKET_IFNAME`` at launch; at least 1)."""


class CallWrapper:
    def __init__(self, state: State, client: dist.Store, client_fds: set[int], monitor: MonitorThread,
                 sockets: SocketTracker, progress: Progress | None, settings: GroupSettings, on_first_ping=None):
        self.state = state
        self._client, self._client_fds = client, client_fds
        self._monitor, self._sockets, self._progress = monitor, sockets, progress
        self._settings = settings
        self._on_first_ping = on_first_ping
        self.records: dict[str, float] = {}
        """Values the function reported with :meth:`record` (``reload_s`` goes into the restart log)."""
        self.last_restart = None
        """The :class:`~.restart_log.RestartRecord` of the restart that began this attempt (cause, fault rank,
        ``t_fault``); ``None`` in the first attempt."""

    def close(self) -> None:
        """The attempt is over: drop every reference to the wrapper's machinery (a function that
        kept its ``call_wrapper`` keeps no store, thread or callback alive through it)."""
        self._client = self._monitor = self._sockets = self._progress = self._on_first_ping = None

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
        if self._client is None:
            raise RuntimeError(f"call_wrapper of attempt {self.iteration} used after its attempt ended")
        return dist.PrefixStore(f"it/{self.iteration}/user", self._client)

    # -- process group -------------------------------------------------------------------------
    def init_process_group(self, backend: str | None = "gloo", timeout: float | timedelta | None = None,
                           **kwargs) -> None:
        """``torch.distributed.init_process_group`` for this attempt: this attempt's rank and
        world size, a fresh store prefix ``it/<n>/pg``, and the gloo part's sockets tracked so an
        abort can cut them. Extra ``kwargs`` go to torch. With ``device_id`` (e.g.
        ``backend="cpu:gloo,cuda:nccl", device_id=device``) the group is created first and its
        NCCL part connected right after, outside the tracked window: NCCL's own sockets are never
        cut (an abort aborts NCCL instead). An NCCL group's ``timeout`` must exceed the hard
        timeout (:class:`ConfigError` otherwise)."""
        if self.rank is None:
            raise RuntimeError("a spare rank has no process group (call_wrapper.rank is None)")
        if self._sockets is None:
            raise RuntimeError(f"call_wrapper of attempt {self.iteration} used after its attempt ended")
        if dist.is_initialized():
            raise RuntimeError("a default process group already exists; create it only via call_wrapper")
        cfg = self._settings
        if timeout is None:
            timeout = cfg.pg_timeout
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        device_id = kwargs.pop("device_id", None)
        if isinstance(device_id, int):
            device_id = torch.device("cuda", device_id)
        if backend is None and device_id is not None:
            backend = dist.Backend.default_device_backend_map.get(device_id.type)
        if uses_nccl(backend, device_id):
            check_nccl_timeout(timeout.total_seconds(), cfg.nccl_min_timeout)
        pg_store = dist.PrefixStore(f"it/{self.iteration}/pg", self._client)
        self._sockets.begin(init_only=self._client_fds)
        try:
            try:
                dist.init_process_group(backend, store=pg_store, rank=self.rank, world_size=self.world_size,
                                        timeout=timeout, **kwargs)
                expected = gloo_sockets(backend, self.world_size, cfg.gloo_transport, cfg.gloo_interfaces)
                self._sockets.await_connected(expected, timeout.total_seconds())
                cap_gloo_timeout(timeout.total_seconds(), cfg.gloo_max_timeout)
            finally:
                self._sockets.commit()
            if device_id is not None:
                connect_device(dist.group.WORLD, device_id)
        finally:
            self._sockets.end_init()
        self._touch()

    # -- progress ------------------------------------------------------------------------------
    def ping(self) -> None:
        """Progress signal (once a step): resets the soft and hard timeouts."""
        self._touch()
        if self._on_first_ping is not None:
            cb, self._on_first_ping = self._on_first_ping, None
            cb(self)

    def _touch(self) -> None:
        if self._monitor is None:
            return  # a call_wrapper kept past its attempt
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
        if self._monitor is None:
            raise RuntimeError(f"call_wrapper of attempt {self.iteration} used after its attempt ended")
        with self._monitor.atomic_lock:
            if self._monitor.interrupting:
                raise RankShouldRestart("attempt is being interrupted; atomic section not entered")
            self._monitor.atomic_depth += 1
            try:
                yield
            finally:
                self._monitor.atomic_depth -= 1
                self._touch()  # the soft timeout, suspended inside, counts from the section's end

