"""In-job restart launcher with rank heartbeats (notebook ``03_launcher_heartbeats.ipynb``).

``python -m nvrx_lab.launcher`` (console script ``nvrx-lab-launch``) takes every torchrun flag and
adds the settings of :class:`~nvrx_lab.launcher.config.LauncherConfig` (``--heartbeat-timeout``,
``--initial-heartbeat-timeout``, ``--section-timeouts``, ``--restart-policy``, ``--standby``, ...) and
``--config FILE.yaml``. Workers report with :class:`RankMonitorClient`. Files, one concept each:

* :mod:`~nvrx_lab.launcher.config` — the launcher's settings, defined once (CLI, YAML, runner, JobSpec)
* :mod:`~nvrx_lab.launcher.cli` — flags (torchrun's parser reused) and YAML config
* :mod:`~nvrx_lab.launcher.agent` — torchelastic agent subclass: heartbeat checks, fresh store per round
* :mod:`~nvrx_lab.launcher.monitor` — per-local-rank monitors over private Unix sockets
* :mod:`~nvrx_lab.launcher.client` — the worker side (:class:`RankMonitorClient`)
* :mod:`~nvrx_lab.launcher.timeouts` — what is a hang; timeouts from observed intervals
* :mod:`~nvrx_lab.launcher.policy` — restart policies ``any-failed`` and ``min-healthy``
* :mod:`~nvrx_lab.launcher.standby` / :mod:`~nvrx_lab.launcher.attach` — warm standby workers
* :mod:`~nvrx_lab.launcher.restart_log` — restart causes for people and for the event stream
* :mod:`~nvrx_lab.demo.launcher_worker` — a tiny training loop with scheduled faults (tests, bench, notebook)

This package imports only the standard library at import time (the client must stay cheap).
"""

from nvrx_lab.launcher.client import RankMonitorClient, RankMonitorClientError
from nvrx_lab.launcher.timeouts import Timeouts

__all__ = ["RankMonitorClient", "RankMonitorClientError", "Timeouts"]
