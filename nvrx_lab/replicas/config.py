"""The replica layer's settings: one object, the trainer's ``--replica*`` and ``--coordinator`` flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from nvrx_lab.cli import Settings


@dataclass
class ReplicaConfig(Settings):
    """Replica-level fault tolerance (``--restart replicas``, nvrx_lab.replicas)."""

    coordinator: str = field(default="", metadata={"flag": "coordinator"})
    """HOST:PORT of the coordinator (python -m nvrx_lab.replicas.coordinator), which forms a quorum per step."""
    replica_id: int = field(default=0, metadata={"flag": "replica-id"})
    """This replica group's id, 0..replicas-1 (torchrun's ranks of one group share it)."""
    replicas: int = field(default=1, metadata={"flag": "replicas"})
    """Replica groups of the job; the global batch is shared among those in each step's quorum."""
    patience: float = field(default=0.0, metadata={"flag": "replica-patience"})
    """Seconds a step's cross-replica reduction may wait before the coordinator hears of it (it then drops the
    member everybody waits for: a hang); 0: twice the median step time so far, at least 50 ms."""
    timeout: float = field(default=300.0, metadata={"flag": "replica-timeout"})
    """Seconds any one operation of the cross-replica data plane (a group's setup, a sum, a heal's chunk) may take
    before it is given up (the coordinator's abort ends it sooner when a member is lost)."""
    hang_timeout: float = field(default=0.0, metadata={"flag": "replica-hang-timeout"})
    """Seconds a rank the others wait for may compute without completing a unit of work (a module's forward or
    backward, an optimizer step, as the device vouches) before its group is dropped as hung; 0: ten times the longest
    such gap in a finished step, at least 3 s (nvrx_lab.replicas.progress)."""

    reconnect_timeout: float = field(default=600.0, metadata={"flag": "replica-reconnect-timeout"})
    """Seconds a rank tries to reach the coordinator again when it is lost (its pod rescheduled, perhaps onto a node
    that first pulls the image); the restarted one goes on from the last committed step (nvrx_lab.replicas.admission)."""

    fingerprint_every: int = field(default=50, metadata={"flag": "replica-fingerprint-every"})
    """Every N committed steps each rank writes a fingerprint of its parameters and optimizer state, which must agree
    across replicas (nvrx_lab.replicas.fingerprint; ~12 ms for Llama 3.1 8B on p5); 0: never."""

    def __post_init__(self):
        if self.replicas < 1 or not 0 <= self.replica_id < self.replicas:
            raise ValueError(f"--replica-id {self.replica_id} must be in 0..--replicas - 1 (--replicas {self.replicas})")
        for flag, value in (("--replica-patience", self.patience), ("--replica-hang-timeout", self.hang_timeout)):
            if not 0 <= value < float("inf"):
                raise ValueError(f"{flag} must be >= 0 seconds (0: derived), got {value}")
        if self.fingerprint_every < 0:
            raise ValueError(f"--replica-fingerprint-every must be >= 0 steps (0: never), got {self.fingerprint_every}")
        for flag, value in (("--replica-timeout", self.timeout), ("--replica-reconnect-timeout", self.reconnect_timeout)):
            if not 0 < value < float("inf"):
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")
        if self.coordinator and (":" not in self.coordinator or not self.coordinator.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"--coordinator {self.coordinator!r} must be HOST:PORT")

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.coordinator.rsplit(":", 1)
        return host, int(port)
