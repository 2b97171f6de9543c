"""Every check of a node, in the order a failure is most likely to matter, with the settings a launcher passes."""

from __future__ import annotations

from dataclasses import dataclass

from nvrx_lab.health import Verdict
from nvrx_lab.health.gpu import gpu
from nvrx_lab.health.nic import SYSFS, nic
from nvrx_lab.health.node import disk, memory, storage


@dataclass(frozen=True)
class HealthSettings:
    folder: str | None = None
    """The checkpoints' folder: written (and fsynced) once, its free space read; None: storage and disk skipped."""
    sysfs: str = SYSFS
    """Where the RDMA devices are listed (a fixture tree in tests)."""
    expected_nics: int | None = None
    """RDMA devices this node must have (the EFA interfaces of the pod); None: any number."""
    meminfo: str = "/proc/meminfo"
    nvml: object | None = None
    """pynvml, or a stand-in with its functions; None: pynvml if installed."""


def run_all(s: HealthSettings) -> list[Verdict]:
    out = [gpu(s.nvml), nic(s.sysfs, s.expected_nics), memory(s.meminfo)]
    if s.folder:
        out += [storage(s.folder), disk(s.folder)]
    return out
