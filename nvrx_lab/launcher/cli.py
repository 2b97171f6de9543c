"""Command line: every ``torchrun`` flag (its own parser, reused) plus the settings of :class:`LauncherConfig`.

::

    python -m nvrx_lab.launcher --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        --max-restarts 3 --heartbeat-timeout 3 --initial-heartbeat-timeout 30 \\
        --section-timeouts checkpoint=60,eval=120 --restart-policy any-failed \\
        --metrics-file build/run/metrics.jsonl  train.py --steps 100

Our flags come from the fields of :class:`~nvrx_lab.launcher.config.LauncherConfig` (their docstrings are the
help). ``--max-restarts``, ``--monitor-interval`` and ``--shutdown-timeout`` (grace between SIGTERM and SIGKILL)
stay torchrun's flags; the config gives them the launcher's defaults (``--shutdown-timeout`` 5 s) and checks
them. ``--config FILE.yaml`` holds the same settings as keys (``heartbeat_timeout: 3``,
``section_timeouts: {checkpoint: 60}``, ...), and torchrun's ``nproc_per_node``, ``nnodes`` and ``rdzv_*``;
explicit flags win over the file, the file over the defaults. An unknown key or a wrong type is an error
naming it. Flags are never abbreviated, and a bad one is one ``error:`` line (:class:`nvrx_lab.cli.Parser`,
with torchrun's parser as its parent).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from torch.distributed.run import get_args_parser

from nvrx_lab.cli import Parser, add_dataclass_args, check_writable, dataclass_from_args
from nvrx_lab.launcher.config import LauncherConfig, SettingError

METRICS_ENV = "NVRX_LAB_METRICS"
SYSFS_ENV = "NVRX_LAB_HEALTH_SYSFS"
"""Where this node's RDMA devices are listed when ``--health-sysfs`` is not given: a node of a local run has its own
fixture tree (:class:`~nvrx_lab.eks.local_job.LocalOptions` ``pod_env``), as each EKS node has its own ``/sys``."""
HEALTH_SYSFS = "/sys/class/infiniband"
"""The event stream's file when ``--metrics-file`` is not given (the trainer's too)."""
TORCHRUN_KEYS = {"nproc_per_node": "an integer", "nnodes": "'N' or 'MIN:MAX'", "rdzv_backend": "a rendezvous backend "
                 "name, e.g. c10d", "rdzv_endpoint": "host:port", "rdzv_id": "a job id"}
"""torchrun's own settings a ``--config`` file may hold besides :class:`LauncherConfig`'s (what each must be)."""


class ConfigError(ValueError):
    """A bad flag or config value; the message names it and what is valid."""


def get_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m nvrx_lab.launcher", parents=[get_args_parser()], add_help=False,  # torchrun's -h joins too
                    description="torchrun with rank heartbeats, warm standby workers and logged restarts (nvrx_lab).")
    g = parser.add_argument_group("heartbeats and restarts (nvrx_lab)")
    add_dataclass_args(g, LauncherConfig)
    g.add_argument("--no-standby", dest="standby", action="store_false", help="start workers cold (--standby false)")
    g.add_argument("--config", default=None, metavar="FILE.yaml", help="YAML file with any of these settings")
    return parser


def load_yaml(path: str) -> dict[str, Any]:
    """The settings in the YAML file ``path``, checked by :class:`LauncherConfig`, as parser defaults."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    ours = {k: v for k, v in data.items() if k in LauncherConfig.flags()}
    for key, value in data.items():
        if key not in ours and key not in TORCHRUN_KEYS:
            valid = sorted([*LauncherConfig.flags(), *TORCHRUN_KEYS])
            raise ConfigError(f"--config {path}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        if key in TORCHRUN_KEYS and (not isinstance(value, (int, str)) or isinstance(value, bool)):
            raise ConfigError(f"--config {path}: key {key!r} must be {TORCHRUN_KEYS[key]}, got {value!r}")
    try:
        config = LauncherConfig.from_kwargs(**ours)
    except SettingError as e:
        raise ConfigError(f"--config {path}: key {e.field!r} {e.problem}") from None
    return {**{k: str(v) for k, v in data.items() if k in TORCHRUN_KEYS}, **{k: getattr(config, k) for k in ours}}


TRACE_ENV = "TORCH_FR_DUMP_TEMP_FILE"
"""torch's prefix of its flight-recorder dumps (the manifests set it to ``$(RUN_DIR)/nccl-trace/rank_``)."""


def parse(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[argparse.Namespace, LauncherConfig]:
    """torchrun's namespace plus our config; flags > YAML > defaults. ``environ``: the launcher's environment
    (``$NVRX_LAB_METRICS``, the event file when ``--metrics-file`` is not given; ``$NVRX_LAB_HEALTH_SYSFS``). Raises
    :class:`ConfigError`."""
    parser = get_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**load_yaml(first.config))
    args = parser.parse_args(argv)
    try:
        config = dataclass_from_args(LauncherConfig, args)
    except SettingError as e:
        raise ConfigError(f"--{e.field.replace('_', '-')} {e.problem}") from None
    if config.health_sysfs == HEALTH_SYSFS and (environ or {}).get(SYSFS_ENV):  # a node's own tree (local runs, tests)
        config.health_sysfs = environ[SYSFS_ENV]
    flag = "--metrics-file"
    if config.metrics_file is None and (environ or {}).get(METRICS_ENV):
        config.metrics_file, flag = environ[METRICS_ENV], f"${METRICS_ENV}"
    if config.metrics_file:  # one error line before anything starts, not a traceback once the workers are up
        try:
            check_writable(config.metrics_file, flag)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return args, config


def trace_dump_prefix(config: LauncherConfig, environ: Mapping[str, str]) -> str | None:
    """Where a hang's flight-recorder dumps go: the setting, else ``$TORCH_FR_DUMP_TEMP_FILE``, else ``nccl-trace/rank_``
    beside the metrics file, else None."""
    if config.trace_dump_prefix is not None:
        return config.trace_dump_prefix
    beside = os.path.join(os.path.dirname(os.path.abspath(config.metrics_file)), "nccl-trace", "rank_") \
        if config.metrics_file else None
    return environ.get(TRACE_ENV) or beside
