"""Node health checks: each a small function with a name, a verdict and the evidence, run before a node joins.

Llama 3's 54 days lost 30 % of their interruptions to faulty GPUs and 17 % to HBM; a node with such a GPU, or a
down EFA port, rejoins after every restart unless something looks first. The checks here look, in well under a
second, at what the node itself can tell:

* :mod:`.gpu` — through NVML (``nvidia-ml-py``): uncorrectable ECC errors, retired pages pending, row-remapping
  failures, NVLink links down;
* :mod:`.nic` — EFA and InfiniBand ports from sysfs (``/sys/class/infiniband/*/ports/*/state``): every port ACTIVE;
* :mod:`.node` — the checkpoint folder writable with a write+fsync latency bound, free memory and disk.

A check that cannot run here (no NVML, no RDMA devices) says so: its verdict is ``skipped`` with the reason, never a
silent pass. ``python -m nvrx_lab.health`` runs them; the launcher runs them before each rendezvous round
(``LauncherConfig.health_checks``) and a node that fails one leaves with exit 5
(:data:`~nvrx_lab.exit_codes.UNHEALTHY`) and one line naming the check.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    check: str
    """``gpu``, ``nic``, ``storage``, ``memory``, ``disk``."""
    status: str
    """``ok``, ``failed`` or ``skipped`` (could not run here: the evidence says why)."""
    evidence: str

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def line(self) -> str:
        return f"health {self.check}: {self.status}: {self.evidence}"


def ok(check: str, evidence: str) -> Verdict:
    return Verdict(check, "ok", evidence)


def failed(check: str, evidence: str) -> Verdict:
    return Verdict(check, "failed", evidence)


def skipped(check: str, evidence: str) -> Verdict:
    return Verdict(check, "skipped", evidence)
