"""Launch: every multi-process command line of the package, and the one bounded way to run it.

Command lines are built from small frozen dataclasses, never by hand:

* :class:`Torchrun` — ``python -m torch.distributed.run`` and its flags;
* :class:`Launcher` — ``python -m nvrx_lab.launcher``: torchrun's rendezvous flags plus a
  :class:`~nvrx_lab.launcher.config.LauncherConfig` (heartbeats, restarts, restart policy);
* :class:`Spawn` — ``python -m nvrx_lab.inprocess.spawn``: plain rank processes, survivors of a dead rank go on;
* :class:`Worker` — what every rank runs: ``-m nvrx_lab.train`` (:func:`trainer`), another module, or a script.

``head.argv(worker)`` is the full command line; :func:`head_for` picks the head a trainer's ``--restart``
mode needs. Flags are written in field order (``None`` and ``False`` left out, ``True`` a bare switch,
field ``ckpt_dir`` as ``--ckpt-dir``; a launcher's settings where they differ from their defaults). On one machine,
``Torchrun.local(2)`` (static store) and ``Launcher.local(2)`` / ``Torchrun.c10d(2)`` (c10d rendezvous)
listen on 127.0.0.1 and a free port pair from :mod:`nvrx_lab.net`. In a pod the values are the pod's
``${VAR}`` references: :mod:`nvrx_lab.eks.commands` renders the same objects into the container script::

    cmd = Launcher.local(2, max_restarts=3, heartbeat_timeout=3).argv(trainer(steps=14, restart="launcher"))
    run(cmd, timeout=180).check()

:func:`run` (:mod:`nvrx_lab.process_group`) is how the package runs a process group (benchmarks, reliability cases, tests,
notebooks): a new session, a bounded wait, the whole group killed on timeout and once the leader has
exited, and a :class:`RunResult` (exit code, output, wall time). Spawned children cannot import
functions defined in a notebook cell, so every multi-process step of the workbook runs a module of
this package this way.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from nvrx_lab.launcher.config import LauncherConfig
from nvrx_lab.net import free_port_pair
from nvrx_lab.process_group import LINGER_S, RunResult, held_by, run

Value = str | int | float | bool | Path | None
LOOPBACK = "127.0.0.1"


def flags_of(items: Iterable[tuple[str, Value]]) -> list[tuple[str, str | None]]:
    """``(field, value)`` pairs as ``(--flag, text)``: ``None``/``False`` dropped, ``True`` a bare switch (text ``None``)."""
    return [("--" + name.replace("_", "-"), None if value is True else str(value))
            for name, value in items if value is not None and value is not False]


def flat(pairs: Iterable[tuple[str, str | None]]) -> list[str]:
    """``[("--steps", "4"), ("--no-standby", None)]`` -> ``["--steps", "4", "--no-standby"]``."""
    return [t for flag, text in pairs for t in ((flag,) if text is None else (flag, text))]


@dataclass(frozen=True)
class Worker:
    """What every rank runs: ``-m TARGET`` (or the script ``TARGET`` when it ends in ``.py``), its flags, ``extra``."""

    target: str
    """A module (``nvrx_lab.train``) or a script path (``tests/workers/launcher_worker.py``)."""
    flags: tuple[tuple[str, Value], ...] = ()
    """``(field, value)`` in order: ``("ckpt_dir", "d")`` is ``--ckpt-dir d`` (see :func:`flags_of`)."""
    extra: tuple[str, ...] = ()
    """Arguments written verbatim after the flags."""

    @classmethod
    def of(cls, target: str | Path, *extra: Value, **flags: Value) -> Worker:
        return cls(str(target), tuple(flags.items()), tuple(str(a) for a in extra))

    def with_flags(self, **flags: Value) -> Worker:
        """The same worker with ``flags`` set (a flag already there keeps its place)."""
        merged = dict(self.flags) | flags
        return dataclasses.replace(self, flags=tuple(merged.items()))

    def pairs(self) -> list[tuple[str, str | None]]:
        return flags_of(self.flags)

    def args(self) -> list[str]:
        """What follows the launcher's flags: ``-m TARGET FLAGS… EXTRA…``."""
        head = [self.target] if self.target.endswith(".py") else ["-m", self.target]
        return [*head, *flat(self.pairs()), *self.extra]

    def argv(self) -> list[str]:
        """The worker alone, without a launcher (a world of one)."""
        return [sys.executable, *self.args()]


def trainer(*extra: Value, **flags: Value) -> Worker:
    """``-m nvrx_lab.train`` with ``flags`` named as the fields of its ``TrainConfig`` (``global_batch=4``)."""
    return Worker.of("nvrx_lab.train", *extra, **flags)


class _Head:
    """A launcher command: its module, its flags (the dataclass fields) and how the worker follows."""

    module: ClassVar[str]

    def flags(self) -> list[tuple[str, str | None]]:
        return flags_of((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    def worker_args(self, worker: Worker | Sequence[str]) -> list[str]:
        return worker.args() if isinstance(worker, Worker) else [str(a) for a in worker]

    def argv(self, worker: Worker | Sequence[str]) -> list[str]:
        """The full command line: ``python -m MODULE FLAGS… WORKER…`` (``worker`` may be raw arguments)."""
        return [sys.executable, "-m", self.module, *flat(self.flags()), *self.worker_args(worker)]


@dataclass(frozen=True)
class _Rendezvous(_Head):
    """torchrun's flags that say how many workers run where and how they meet: a static store (``master_*``) or a
    c10d rendezvous (``rdzv_*``). Shared by :class:`Torchrun` and :class:`Launcher`."""

    nnodes: int | str | None = None
    nproc_per_node: int | str = 1
    """Workers on this node."""
    node_rank: int | str | None = None
    master_addr: str | None = None
    master_port: int | str | None = None
    """Static store on rank 0's node (the in-process restart store uses the next port)."""
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of the c10d rendezvous store."""
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    local_addr: str | None = None

    @classmethod
    def local(cls, nproc: int, port: int | None = None, **flags: Value):
        """``nproc`` workers here, rank 0's static store on 127.0.0.1 and a free port pair."""
        return cls.of(nproc_per_node=nproc, master_addr=LOOPBACK, master_port=port or free_port_pair(), **flags)

    @classmethod
    def c10d(cls, nproc: int, port: int | None = None, **flags: Value):
        """``nproc`` workers here, a c10d rendezvous on 127.0.0.1 and a free port pair."""
        return cls.of(nproc_per_node=nproc, rdzv_backend="c10d", rdzv_endpoint=f"{LOOPBACK}:{port or free_port_pair()}",
                      **flags)

    @classmethod
    def of(cls, **flags: Value):
        """``cls(**flags)``; :class:`Launcher` takes its settings from ``flags`` too."""
        return cls(**flags)


@dataclass(frozen=True)
class Torchrun(_Rendezvous):
    """``python -m torch.distributed.run``: where the workers meet, and how torchrun restarts them."""

    max_restarts: int | str | None = None
    """Restarts of the worker group after a failure (torchrun's default: 0)."""
    monitor_interval: float | str | None = None
    """Seconds between checks of the workers."""
    shutdown_timeout: float | None = None
    """Seconds between SIGTERM and SIGKILL when workers are stopped."""

    module: ClassVar[str] = "torch.distributed.run"


@dataclass(frozen=True)
class Launcher(_Rendezvous):
    """``python -m nvrx_lab.launcher``: where the workers meet (torchrun's flags), then the launcher's settings,
    one :class:`~nvrx_lab.launcher.config.LauncherConfig` written as the flags that differ from its defaults."""

    settings: LauncherConfig = field(default_factory=LauncherConfig, hash=False)
    """Restarts, heartbeats, sections, restart policy, standby workers, the event stream."""
    config: str | Path | None = None
    """YAML file with any of the launcher's settings: the flags win over it, and a setting left at its default is
    not written as a flag, so the file's value for it applies."""

    module: ClassVar[str] = "nvrx_lab.launcher"

    @classmethod
    def local(cls, nproc: int, port: int | None = None, **flags: Value):
        """``nproc`` workers here; the launcher always meets over c10d (127.0.0.1, a free port pair)."""
        return cls.c10d(nproc, port, **flags)

    @classmethod
    def of(cls, settings: LauncherConfig | None = None, **flags: Value) -> Launcher:
        """From flag-named values: torchrun's fields above, ``config``, and any setting of :class:`LauncherConfig`
        (``heartbeat_timeout=3``, ``section_timeouts="checkpoint=20"``: :meth:`LauncherConfig.from_kwargs`), those
        over ``settings`` when given."""
        own = {f.name for f in dataclasses.fields(cls)}
        base = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)} if settings else {}
        settings = LauncherConfig.from_kwargs(**base | {k: v for k, v in flags.items() if k not in own})
        return cls(**{k: v for k, v in flags.items() if k in own}, settings=settings)  # type: ignore[arg-type]

    def flags(self) -> list[tuple[str, str | None]]:
        where = flags_of((f.name, getattr(self, f.name)) for f in dataclasses.fields(_Rendezvous))
        return [*where, *self.settings.pairs(), *flags_of([("config", self.config)])]


@dataclass(frozen=True)
class Spawn(_Head):
    """``python -m nvrx_lab.inprocess.spawn``: ranks as plain processes that outlive a dead peer."""

    nproc: int = 2
    master_port: int | None = None
    """MASTER_PORT given to the ranks (default: a free pair)."""
    timeout: float | None = None
    """Kill every rank after this many seconds."""

    module: ClassVar[str] = "nvrx_lab.inprocess.spawn"

    def worker_args(self, worker: Worker | Sequence[str]) -> list[str]:
        return ["--", sys.executable, *super().worker_args(worker)]


def head_for(restart: str, nproc: int, port: int | None = None, spawn: bool = False,
             **launcher: Value) -> Torchrun | Launcher | Spawn:
    """What launches the trainer with ``--restart RESTART`` here: :class:`Launcher` (with the ``launcher``
    flags) for ``launcher`` and ``launcher+inprocess``; else torchrun's static store, or :class:`Spawn` for
    ``inprocess`` when ``spawn`` (torchrun stops the survivors of a SIGKILL; spawn lets them go on)."""
    if restart.startswith("launcher"):
        return Launcher.local(nproc, port, **launcher)
    if spawn and restart == "inprocess":
        return Spawn(nproc, master_port=port)
    return Torchrun.local(nproc, port)


def torchrun(nproc: int, *args: str, timeout: float = 300, env: dict | None = None, port: int | None = None) -> RunResult:
    """``python -m torch.distributed.run --nproc-per-node N ARGS…`` on 127.0.0.1 and a free port pair."""
    return run(Torchrun.local(nproc, port).argv(args), timeout, env)


__all__ = ["LINGER_S", "Launcher", "LauncherConfig", "RunResult", "Spawn", "Torchrun", "Worker", "flags_of", "flat", "head_for",
           "held_by", "run", "torchrun", "trainer"]
