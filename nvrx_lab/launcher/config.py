"""The launcher's settings, defined once: :class:`LauncherConfig`.

One dataclass, loadable three ways alike (:class:`nvrx_lab.cli.Settings`): flags joined to torchrun's own
parser (:mod:`nvrx_lab.launcher.cli`), a YAML file of the same keys (``--config FILE.yaml``), and keyword
arguments (``LauncherConfig(heartbeat_timeout=3)``). :class:`nvrx_lab.runner.Launcher` writes one as a
command line (:meth:`LauncherConfig.pairs`) and :class:`nvrx_lab.eks.JobSpec` holds one for its pods.
Adding a setting is adding a field here: its docstring is its ``--help``, its check goes in
``__post_init__``, and the CLI, the YAML file, the runner and the JobSpec take it from here.

The first three fields are torchrun's own flags (``metadata=TORCHRUN``): torchrun's parser declares them,
this class gives them the launcher's defaults and checks their values. A bad value is a
:class:`SettingError` (a ``ValueError``) naming the field and what is valid.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from nvrx_lab.cli import Settings
from nvrx_lab.launcher.timeouts import Timeouts, parse_section_timeouts

TORCHRUN = {"torchrun": True}
"""Field metadata: torchrun's parser declares this flag; the launcher sets its default."""
POLICIES = ("any-failed", "min-healthy")
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo")
"""What the standby zygote imports by default: torch, and what a worker of a DCP + FSDP2 job imports before its
first step (``fully_shard`` loads dynamo: 0.35 s of a warm restart on 2 cores). CUDA is never initialised."""


class SettingError(ValueError):
    """A bad value of one setting: ``field`` and ``problem`` (``must be > 0 seconds, got 0``), so each way in says it
    in its own words (``--heartbeat-timeout``, ``key 'heartbeat_timeout'``, ``LauncherConfig.heartbeat_timeout``)."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"LauncherConfig.{name}: {problem}")
        self.field, self.problem = name, problem


def _seconds_flag(text: str) -> float:
    """A timeout flag's text; argparse puts the flag's name before the message."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def _sections_flag(text: str) -> dict[str, float]:
    try:
        return parse_section_timeouts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _modules(text: str) -> list[str]:
    return [m for m in text.split(",") if m]


SECONDS = {"parse": _seconds_flag}


@dataclass
class LauncherConfig(Settings):
    """What this launcher adds to torchrun's configuration, and the torchrun settings it gives its own defaults."""

    max_restarts: int = field(default=0, metadata=TORCHRUN)
    """Restarts of the worker group after a failure before the launcher gives up (torchrun's ``--max-restarts``)."""
    monitor_interval: float = field(default=0.1, metadata=TORCHRUN)
    """Seconds between checks of worker exits and heartbeats (torchrun's ``--monitor-interval``)."""
    shutdown_timeout: int = field(default=5, metadata=TORCHRUN)
    """Seconds between SIGTERM and SIGKILL when workers are stopped (torchrun's ``--shutdown-timeout``; its own
    default is 30)."""
    heartbeat_timeout: float = field(default=30.0, metadata=SECONDS)
    """Longest silence between two heartbeats before a rank counts as hung (s)."""
    initial_heartbeat_timeout: float = field(default=120.0, metadata=SECONDS)
    """From init_workload_monitoring to the first heartbeat (s)."""
    section_timeouts: dict[str, float] = field(default_factory=dict, metadata={"parse": _sections_flag})
    """Timeouts of named sections, NAME=S,... (e.g. checkpoint=60,eval=120); inside a section the heartbeat timeout
    is suspended."""
    restart_policy: Literal["any-failed", "min-healthy"] = "any-failed"
    """any-failed: any lost worker restarts the group; min-healthy: only below --min-healthy live workers."""
    min_healthy: int | None = field(default=None, metadata={"parse": int})
    """For min-healthy: fewest live local workers to carry on with (default: all of them)."""
    standby: bool = True
    """Run workers in warm standby processes with torch already imported (--no-standby: cold starts)."""
    standby_preload: list[str] = field(default_factory=lambda: list(PRELOAD),
                                       metadata={"parse": _modules})
    """Modules the standby zygote imports once, comma-separated (never anything that initialises CUDA)."""
    metrics_file: str | None = field(default=None, metadata={"parse": str})
    """JSONL event stream for restart events (default: $NVRX_LAB_METRICS, else none)."""
    max_no_progress_cycles: int = field(default=3, metadata={"parse": int})
    """Failed attempts in a row that committed no newer checkpoint (the metrics stream's ``ckpt_commit``) before the
    launcher stops with exit 4 instead of restarting (NVRx's setting of this name, 3); 0: never. Needs the metrics
    file."""
    health_checks: bool = True
    """Before each rendezvous round, this node's health checks (:mod:`nvrx_lab.health`: GPUs through NVML, RDMA
    ports, the metrics folder's storage, memory); a node that fails one leaves with exit 5 (--no-health-checks: off)."""
    health_sysfs: str = field(default="/sys/class/infiniband", metadata={"parse": str})
    """Where the RDMA devices are listed (tests point it at a fixture tree)."""
    mark_node: str = field(default="", metadata={"parse": str})
    """The Kubernetes node to label and taint when a health check fails (:mod:`nvrx_lab.health.mark`; pods: the
    downward API's ``spec.nodeName``); empty: not marked."""
    trace_dump_prefix: str | None = field(default=None, metadata={"parse": str})
    """Where a hang's flight-recorder dumps go, ``<prefix><rank>`` (default: $TORCH_FR_DUMP_TEMP_FILE, torch's own
    dumps' naming; else ``nccl-trace/rank_`` beside the metrics file; else none, and said)."""

    def __post_init__(self) -> None:
        self.max_restarts = _integer("max_restarts", self.max_restarts, 0)
        self.max_no_progress_cycles = _integer("max_no_progress_cycles", self.max_no_progress_cycles, 0)
        self.monitor_interval = _seconds("monitor_interval", self.monitor_interval)
        self.shutdown_timeout = _integer("shutdown_timeout", self.shutdown_timeout, 0)
        self.heartbeat_timeout = _seconds("heartbeat_timeout", self.heartbeat_timeout)
        self.initial_heartbeat_timeout = _seconds("initial_heartbeat_timeout", self.initial_heartbeat_timeout)
        self.section_timeouts = _sections(self.section_timeouts)
        if self.restart_policy not in POLICIES:
            raise SettingError("restart_policy", f"must be 'any-failed' or 'min-healthy', got {self.restart_policy!r}")
        if self.min_healthy is not None:
            self.min_healthy = _integer("min_healthy", self.min_healthy, 1)
        for name in ("standby", "health_checks"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(name, f"must be true or false, got {getattr(self, name)!r}")
        self.standby_preload = _module_list(self.standby_preload)
        if self.metrics_file is not None and not isinstance(self.metrics_file, (str, os.PathLike)):
            raise SettingError("metrics_file", f"must be a file path, got {self.metrics_file!r}")
        self.metrics_file = None if self.metrics_file is None else os.fspath(self.metrics_file)

    def timeouts(self) -> Timeouts:
        """What the rank monitors enforce until a worker sends its own."""
        return Timeouts(initial=self.initial_heartbeat_timeout, steady=self.heartbeat_timeout,
                        sections=dict(self.section_timeouts))

    def pairs(self) -> list[tuple[str, str | None]]:
        """``(--flag, text)`` of each setting that differs from its default, in field order: the command line that
        gives ``python -m nvrx_lab.launcher`` this config. ``None`` text: a bare switch."""
        default = LauncherConfig()
        out: list[tuple[str, str | None]] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                flag = "--" + f.name.replace("_", "-")
                out.append(("--no-standby", None) if f.name == "standby" and value is False else (flag, _text(value)))
        return out

    def flag_text(self, name: str) -> str | None:
        """Setting ``name`` as its flag's text: ``3.0`` -> ``3``, ``{"checkpoint": 60.0}`` -> ``checkpoint=60``, a
        list comma-separated; ``True`` -> ``None`` (a bare switch)."""
        return _text(getattr(self, name))


def _text(value: Any) -> str | None:
    if value is True:
        return None
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, dict):
        return ",".join(f"{k}={_text(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _seconds(name: str, value: Any) -> float:
    if not _is_number(value):
        raise SettingError(name, f"must be a number of seconds, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise SettingError(name, f"must be > 0 seconds, got {value!r}")
    return float(value)


def _integer(name: str, value: Any, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SettingError(name, f"must be an integer >= {least}, got {value!r}")
    if value < least:
        raise SettingError(name, f"must be >= {least}, got {value!r}")
    return value


def _sections(value: Any) -> dict[str, float]:
    """``{"checkpoint": 60}`` or ``"checkpoint=60,eval=120"`` -> ``{"checkpoint": 60.0, ...}``."""
    if isinstance(value, dict):
        value = ",".join(f"{name}={seconds}" for name, seconds in value.items())
    if not isinstance(value, str):
        raise SettingError("section_timeouts", f"must be a mapping name: seconds (or 'name=s,...'), got {value!r}")
    try:
        return parse_section_timeouts(value)
    except ValueError as e:
        raise SettingError("section_timeouts", str(e).removeprefix("--section-timeouts: ")) from None


def _module_list(value: Any) -> list[str]:
    if isinstance(value, str):
        value = _modules(value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) and m for m in value):
        raise SettingError("standby_preload", f"must be a list of module names, got {value!r}")
    return list(value)
