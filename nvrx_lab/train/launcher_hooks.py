"""The trainer's side of the in-job restart launcher (``--restart launcher``): heartbeats and sections from
:class:`nvrx_lab.launcher.RankMonitorClient`, timeouts computed from what was observed and carried in the
checkpoint, and what the launcher said of the failure it restarted these workers for."""

from __future__ import annotations

import contextlib
import json

from nvrx_lab.dist import LaunchEnv
from nvrx_lab.train.hooks import Attempt, Hooks, Recovering


class LauncherHooks(Hooks):
    """The trainer's side of the launcher: heartbeats, a section around checkpoint I/O, and timeouts
    computed from observed intervals and carried in the checkpoint (``state_dict``, key ``monitor``)."""

    name = "monitor"

    def __init__(self):
        from nvrx_lab.launcher import RankMonitorClient

        self.client = RankMonitorClient()
        self.started = False
        self.calculated = False
        self.saves = 0

    def start(self, attempt: Attempt) -> None:
        """After the process group exists; re-entrant across in-process restarts."""
        if not self.started:
            self.client.init_workload_monitoring()
            self.started = True

    def after_step(self, step: int) -> None:
        self.client.send_heartbeat()

    def section(self, name: str):
        # the per-step commit poll and a local snapshot are quick and frequent: no section of their own
        quick = name in ("checkpoint_commit", "checkpoint_local")
        return contextlib.nullcontext() if quick else _Section(self.client, name)

    def after_save(self) -> None:
        """After the second save, set timeouts from what was observed (a collective on all ranks).

        Not after the first: only the second ``async_save`` can wait for a write still in flight, the
        longest legitimate stay in the ``checkpoint`` section. A floor of 3 s keeps a noisy shared CPU
        from reading a slow step as a hang; on GPUs with steady step times the factor 5 dominates."""
        self.saves += 1
        if not self.calculated and self.saves >= 2:
            self.client.calculate_timeouts(safety_factor=5.0, floor=3.0)
            self.calculated = True

    def state_dict(self) -> str:
        return json.dumps(self.client.state_dict())

    def load_state_dict(self, text: str) -> None:
        state = json.loads(text)
        self.client.load_state_dict(state)
        self.calculated = bool(state.get("timeouts"))

    def close(self) -> None:
        if self.started:
            self.client.shutdown_workload_monitoring()
            self.started = False


class _Section:
    def __init__(self, client, name: str):
        self.client, self.name = client, name

    def __enter__(self):
        self.client.start_section(self.name)

    def __exit__(self, *exc):
        self.client.end_section(self.name)


def launcher_recovering(launch: LaunchEnv) -> Recovering | None:
    """The failure the launcher restarted these workers for (:meth:`RankMonitorClient.last_failure`), if any."""
    if launch.restart_count == 0:
        return None
    from nvrx_lab.launcher import RankMonitorClient

    failure = RankMonitorClient.last_failure()
    return Recovering(failure["t"], failure["rank"], failure["cause"]) if failure else None
