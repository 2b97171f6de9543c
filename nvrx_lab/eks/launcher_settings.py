"""A pod's launcher settings: :data:`POD_LAUNCHER` over the launcher's own defaults, and a spec's changes to them
(:class:`~nvrx_lab.eks.spec.JobSpec`'s ``launcher`` and its shorthand fields)."""

from __future__ import annotations

import dataclasses

from nvrx_lab.eks.modes import MODES
from nvrx_lab.runner import LauncherConfig

POD_LAUNCHER = dict(max_restarts=10, monitor_interval=1.0, heartbeat_timeout=300.0, initial_heartbeat_timeout=900.0)
"""Where a pod's launcher differs from the launcher's own defaults. ``max_restarts``: group restarts on one node
before its launcher gives up (and closes the rendezvous, which fails every pod: see ``backoff_limit``);
``monitor_interval``: seconds between checks of worker exits and heartbeats; ``heartbeat_timeout``: seconds
without a heartbeat, after the first, before a rank counts as hung; ``initial_heartbeat_timeout``: until the
first heartbeat (imports, model build, checkpoint load from FSx). The ``checkpoint`` section's timeout, unless
set, comes from the model and the FSx (:attr:`JobSpec.rendered_launcher`): a long save is not a hang."""


def pod_launcher(**settings) -> LauncherConfig:
    """The launcher's settings for a pod: :data:`POD_LAUNCHER` over the launcher's defaults, then ``settings``."""
    return LauncherConfig.from_kwargs(**(POD_LAUNCHER | settings))


def launcher_for(config: LauncherConfig, mode_name: str, changes: dict) -> LauncherConfig:
    """``config`` with ``changes`` (the shorthand fields) and the restart policy of the mode; a new object (a spec
    made by ``dataclasses.replace`` shares its original's)."""
    if not isinstance(config, LauncherConfig):
        raise ValueError(f"JobSpec.launcher: expected a LauncherConfig (e.g. pod_launcher(heartbeat_timeout=60)), "
                         f"got {type(config).__name__}")
    if mode_name in MODES and MODES[mode_name].uses_launcher:
        changes["restart_policy"] = MODES[mode_name].restart_policy
    try:
        return dataclasses.replace(config, **changes)
    except ValueError as e:  # "LauncherConfig.<field>: <problem>"
        raise ValueError(f"JobSpec.launcher.{str(e).removeprefix('LauncherConfig.')}") from None
