"""The writer yields to training: lower CPU and I/O priority, optionally its own cores.

A writer process shares the node with the ranks it writes for. At the same priority the kernel splits
a core between them, so a checksum or a page-cache copy that happens to run while a rank computes
slows that rank's step, and a synchronous job waits for its slowest rank. The writer has time (it
only has to finish before the next save); the ranks do not. So it can start at a higher ``nice`` value
(e.g. 10), in the lowest best-effort I/O class, and on cores of its own. Off by default: on this 2-core
box its gain was within the noise (``bench efficiency``'s ``async-writer-yields`` row); on p5 the host has
192 vCPUs for 8 GPUs, and a few for the writers cost training nothing.

One setting is on by default: the writer runs under ``SCHED_BATCH`` (``policy="batch"``). It gets the same
share of the CPU as before, but waking it never preempts the task that woke it. At the same ``nice``, the
trainer's ``async_save`` sends the request and the kernel switches to the freshly woken writer on the
trainer's own core: 2.5 ms of the save's blocking time here (0.4 ms under ``SCHED_BATCH``).

``ionice`` acts only under an I/O scheduler that honours priorities (BFQ, CFQ); with ``none`` or
``mq-deadline`` on NVMe, and on Lustre, where the bottleneck is the network, it changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

POLICIES = {"normal": os.SCHED_OTHER, "batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}
IONICE_CLASSES = ("none", "idle", "best-effort:0", "best-effort:1", "best-effort:2", "best-effort:3", "best-effort:4",
                  "best-effort:5", "best-effort:6", "best-effort:7")


@dataclass(frozen=True)
class WriterPriority:
    """How the writer process yields to training (applied by the writer itself, at start); the trainer's
    ``--ckpt-writer-*`` flags, whose names the errors use."""

    nice: int = 0
    """Niceness the writer process adds to the trainer's, 0..19 (0 = training's CPU priority; 10 yields the cores to
    the ranks)."""
    ionice: str = "none"
    """The writer's I/O class: best-effort:0 .. best-effort:7 (lowest), idle (only when no one else reads or writes:
    a busy data loader can starve it), or none (inherit)."""
    cpus: tuple[int, ...] = field(default=(), metadata={"parse": str})
    """Cores the writer runs on, e.g. 90,91 (empty = the trainer's)."""
    policy: str = "batch"
    """The writer's scheduling policy: batch (the same CPU share, but its wake-ups never preempt a rank), normal (the
    trainer's), or idle (only what no one else wants: a busy node can starve it)."""

    def __post_init__(self):
        if isinstance(self.nice, bool) or not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            raise ValueError(f"--ckpt-writer-nice must be an int in 0..19 (added to the trainer's), got {self.nice!r}")
        if self.ionice not in IONICE_CLASSES:
            raise ValueError(f"--ckpt-writer-ionice must be one of {', '.join(IONICE_CLASSES)}; got {self.ionice!r}")
        cpus = self.cpus
        if isinstance(cpus, str):  # a flag's or a YAML file's "90,91"
            try:
                cpus = tuple(int(c) for c in cpus.split(",") if c.strip())
            except ValueError:
                raise ValueError(f"--ckpt-writer-cpus must be comma-separated core numbers such as 90,91; got "
                                 f"{self.cpus!r}") from None
        cpus = tuple(cpus)
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus):
            raise ValueError(f"--ckpt-writer-cpus must be core numbers >= 0, got {self.cpus!r}")
        object.__setattr__(self, "cpus", cpus)
        if self.policy not in POLICIES:
            raise ValueError(f"--ckpt-writer-policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")

    def apply(self) -> list[str]:
        """Lower this process's priority; returns what could not be applied (and why), never raises."""
        import psutil

        skipped = []
        if self.policy != "normal":
            try:
                os.sched_setscheduler(0, POLICIES[self.policy], os.sched_param(0))
            except OSError as e:
                skipped.append(f"policy {self.policy}: {e}")
        if self.nice:
            os.nice(self.nice)
        if self.ionice != "none":
            cls, _, level = self.ionice.partition(":")
            try:
                if cls == "idle":
                    psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)
                else:
                    psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, int(level))
            except (OSError, psutil.Error) as e:  # a sandbox without ioprio_set: the CPU priority still holds
                skipped.append(f"ionice {self.ionice}: {e}")
        if self.cpus:
            try:
                os.sched_setaffinity(0, self.cpus)
            except OSError as e:  # a core this container does not have
                skipped.append(f"cpus {list(self.cpus)}: {e}")
        return skipped

    def as_args(self) -> str:
        """Python source of the keyword arguments that rebuild it in the writer's command line."""
        return f"nice={self.nice!r}, ionice={self.ionice!r}, cpus={self.cpus!r}, policy={self.policy!r}"
