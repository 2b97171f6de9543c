"""Command line: every ``torchrun`` flag (its own parser, reused) plus the heartbeat flags.

::

    python -m nvrx_lab.launcher --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        --max-restarts 3 --heartbeat-timeout 3 --initial-heartbeat-timeout 30 \\
        --section-timeouts checkpoint=60,eval=120 --restart-policy any-failed \\
        --metrics-file build/run/metrics.jsonl  train.py --steps 100

``--monitor-interval`` and ``--shutdown-timeout`` (grace between SIGTERM and SIGKILL) are torchrun's
own flags; we only lower the latter's default to 5 s. ``--config FILE.yaml`` holds the same settings
as keys (``heartbeat_timeout: 3``, ``section_timeouts: {checkpoint: 60}``, ...); explicit flags win
over the file, the file over the defaults. An unknown key or a wrong type is an error naming it.
Flags are never abbreviated, and a bad one is one ``error:`` line (:class:`nvrx_lab.cli.Parser`, with
torchrun's parser as its parent).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.run import get_args_parser

from nvrx_lab.cli import Parser, check_writable
from nvrx_lab.launcher.restart_log import METRICS_ENV
from nvrx_lab.launcher.timeouts import Timeouts, parse_section_timeouts


@dataclass
class LauncherSettings:
    """What this launcher adds to torchrun's configuration."""

    heartbeat_timeout: float = 30.0
    """Steady timeout: longest allowed silence between two heartbeats (s)."""
    initial_heartbeat_timeout: float = 120.0
    """From init_workload_monitoring to the first heartbeat (s)."""
    section_timeouts: dict[str, float] = field(default_factory=dict)
    """Per named section (s); inside a section the heartbeat timeout is suspended."""
    restart_policy: str = "any-failed"
    """any-failed: any lost worker restarts the group; min-healthy: only below --min-healthy workers."""
    min_healthy: int | None = None
    """For min-healthy: fewest live local workers to carry on with (default: all of them)."""
    standby: bool = True
    """Run workers in warm standby processes with torch already imported (see standby.py)."""
    standby_preload: list[str] = field(default_factory=lambda: ["torch", "torch.distributed"])
    """Modules the standby zygote imports once (never anything that initialises CUDA)."""
    metrics_file: str | None = None
    """JSONL event stream for restart events (default: $NVRX_LAB_METRICS, else none)."""

    def timeouts(self) -> Timeouts:
        return Timeouts(initial=self.initial_heartbeat_timeout, steady=self.heartbeat_timeout,
                        sections=dict(self.section_timeouts))


# YAML key -> (type check, expected description); torchrun keys allowed in YAML too
_YAML_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "heartbeat_timeout": ((int, float), "a number of seconds"),
    "initial_heartbeat_timeout": ((int, float), "a number of seconds"),
    "monitor_interval": ((int, float), "a number of seconds"),
    "section_timeouts": ((dict, str), "a mapping name: seconds (or 'name=s,...')"),
    "restart_policy": ((str,), "'any-failed' or 'min-healthy'"),
    "min_healthy": ((int,), "an integer >= 1"),
    "standby": ((bool,), "true or false"),
    "standby_preload": ((list, str), "a list of module names"),
    "metrics_file": ((str,), "a file path"),
    "max_restarts": ((int,), "an integer >= 0"),
    "shutdown_timeout": ((int,), "an integer number of seconds"),
    "nproc_per_node": ((int, str), "an integer"),
    "nnodes": ((int, str), "'N' or 'MIN:MAX'"),
    "rdzv_backend": ((str,), "a rendezvous backend name, e.g. c10d"),
    "rdzv_endpoint": ((str,), "host:port"),
    "rdzv_id": ((str,), "a job id"),
}


class ConfigError(ValueError):
    """A bad flag or config value; the message names it and what is valid."""


def _seconds(text: str) -> float:
    """A timeout flag's value; argparse prefixes the flag's name to the error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def _sections(text: str) -> dict[str, float]:
    try:
        return parse_section_timeouts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def get_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m nvrx_lab.launcher", parents=[get_args_parser()], add_help=False,  # torchrun's -h joins too
                    description="torchrun with rank heartbeats, warm standby workers and logged restarts (nvrx_lab).")
    g = parser.add_argument_group("heartbeats and restarts (nvrx_lab)")
    d = LauncherSettings()
    g.add_argument("--heartbeat-timeout", type=_seconds, default=d.heartbeat_timeout,
                   help="longest silence between two heartbeats before a rank is declared hung (s)")
    g.add_argument("--initial-heartbeat-timeout", type=_seconds,
                   default=d.initial_heartbeat_timeout, help="from init_workload_monitoring to the first heartbeat (s)")
    g.add_argument("--section-timeouts", type=_sections, default={}, metavar="NAME=S,...",
                   help="timeouts of named sections, e.g. checkpoint=60,eval=120")
    g.add_argument("--restart-policy", choices=["any-failed", "min-healthy"], default=d.restart_policy,
                   help="any-failed: restart on any lost worker; min-healthy: only below --min-healthy live workers")
    g.add_argument("--min-healthy", type=int, default=None, help="min-healthy: fewest live local workers (default all)")
    g.add_argument("--standby", action=argparse.BooleanOptionalAction, default=d.standby,
                   help="keep a warm standby worker per local rank with torch imported")
    g.add_argument("--standby-preload", type=lambda s: [m for m in s.split(",") if m], default=d.standby_preload,
                   help="comma-separated modules the standby zygote imports (default torch,torch.distributed)")
    g.add_argument("--metrics-file", default=None, help="JSONL event stream for restart events (or $NVRX_LAB_METRICS)")
    g.add_argument("--config", default=None, metavar="FILE.yaml", help="YAML file with any of these settings")
    parser.set_defaults(shutdown_timeout=5)
    return parser


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k not in _YAML_KEYS:
            raise ConfigError(f"--config {path}: unknown key {key!r}; valid keys: {', '.join(sorted(_YAML_KEYS))}")
        types, expected = _YAML_KEYS[k]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(f"--config {path}: key {key!r} must be {expected}, got {value!r}")
        if k == "section_timeouts":
            try:
                value = parse_section_timeouts(value) if isinstance(value, str) else \
                    parse_section_timeouts(",".join(f"{n}={s}" for n, s in value.items()))
            except ValueError as e:
                raise ConfigError(f"--config {path}: key 'section_timeouts': {e}") from None
        elif k in ("heartbeat_timeout", "initial_heartbeat_timeout", "monitor_interval") and not value > 0:
            raise ConfigError(f"--config {path}: key {key!r} must be > 0 seconds, got {value!r}")
        elif k == "restart_policy" and value not in ("any-failed", "min-healthy"):
            raise ConfigError(f"--config {path}: key 'restart_policy' must be {expected}, got {value!r}")
        elif k == "standby_preload" and isinstance(value, str):
            value = [m for m in value.split(",") if m]
        out[k] = str(value) if k in ("nproc_per_node", "nnodes") else value
    return out


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, LauncherSettings]:
    """torchrun's namespace plus our settings; flags > YAML > defaults. Raises :class:`ConfigError`."""
    parser = get_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**load_yaml(first.config))
    args = parser.parse_args(argv)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.monitor_interval <= 0:
        raise ConfigError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    if args.min_healthy is not None and args.min_healthy < 1:
        raise ConfigError(f"--min-healthy must be >= 1, got {args.min_healthy}")
    settings = LauncherSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LauncherSettings)})
    check_metrics_file(settings.metrics_file)
    return args, settings


def check_metrics_file(path: str | None) -> None:
    """The restart log's event file (``--metrics-file``, else ``$NVRX_LAB_METRICS``) must be writable: one
    ``error:`` line before anything starts, not a traceback once the workers are up."""
    flag = "--metrics-file" if path else f"${METRICS_ENV}"
    path = path or os.environ.get(METRICS_ENV)
    if path:
        try:
            check_writable(path, flag)
        except ValueError as e:
            raise ConfigError(str(e)) from None
