"""The pods of a local run and what happened to them: :class:`LocalPod`, :class:`PodEvent`, :class:`LocalRun`.

:func:`~nvrx_lab.eks.local_plan.plan` fills in what each pod runs (argv, environment, mounts, ports);
the controller of :mod:`nvrx_lab.eks.local` records every start, exit and lost node, and how the run ended.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LocalPod:
    index: int
    """Completion index = node rank."""
    hostname: str
    """``<job>-<index>``, as the Indexed Job names the pod's host."""
    argv: list[str]
    """The container's command + args after mapping."""
    env: dict[str, str]
    """The container's environment after mapping (the image's variables underneath)."""
    logs: list[Path] = field(default_factory=list)
    """One log file per attempt."""
    returncodes: list[int] = field(default_factory=list)
    """Exit code of each attempt."""
    proc: subprocess.Popen | None = None


@dataclass(frozen=True)
class PodEvent:
    """One thing the controller did or saw, in order."""

    t: float
    """Wall time (``time.time()``: comparable with the trainer's events)."""
    index: int
    kind: str
    """``start`` (an attempt began), ``exit`` (it ended by itself, ``code``), ``node-lost`` (killed with its node) or
    ``stopped`` (ended by a JobSet's group recreate)."""
    attempt: int
    code: int | None = None


@dataclass
class LocalRun:
    pods: list[LocalPod]
    workdir: Path
    mounts: dict[str, Path]
    """Mount path in the pod -> local directory."""
    ports: dict[int, int]
    """Service port -> local port."""
    status: str = "pending"
    """Succeeded, Failed (backoffLimit, a FailJob rule, or a JobSet out of restarts or failed by a rule) or timeout."""
    reason: str = ""
    """Why it failed, as the Job's condition says: ``BackoffLimitExceeded`` or ``PodFailurePolicy``; a JobSet's
    ``FailJobSet on <reason>`` (a rule) or ``MaxRestarts after <reason>``."""
    failures: int = 0
    """Pod failures counted against ``backoffLimit`` (what ``podFailurePolicy`` neither ignores nor turns into FailJob)."""
    group_restarts: int = 0
    """JobSet only: times every pod was recreated after its child Job failed (``failurePolicy.maxRestarts``)."""
    wall_s: float = 0.0
    events: list[PodEvent] = field(default_factory=list)
    """Every start, exit and lost node, in order."""

    @property
    def ok(self) -> bool:
        return self.status == "Succeeded"

    def local_path(self, pod_path: str) -> Path:
        """Where a path inside the pod (e.g. ``/fsx/job/metrics.jsonl``) lives on this machine."""
        local = under_mount(self.mounts, pod_path)
        if local is None:
            raise ValueError(f"{pod_path!r} is not under any volume mount ({', '.join(self.mounts)})")
        return local

    def log(self, index: int = 0, attempt: int = -1) -> str:
        return self.pods[index].logs[attempt].read_text(errors="replace") if self.pods[index].logs else ""


def under_mount(mounts: dict[str, Path], pod_path: str) -> Path | None:
    """Where ``pod_path`` lives on this machine: under the longest volume mount that holds it (``None``: none does)."""
    for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if pod_path == mount or pod_path.startswith(mount.rstrip("/") + "/"):
            return local / pod_path[len(mount):].lstrip("/")
    return None


__all__ = ["LocalPod", "LocalRun", "PodEvent", "under_mount"]
