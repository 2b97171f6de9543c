"""The knobs of :class:`~nvrx_lab.checkpoint.AsyncCheckpointer`, one field each with its docs."""

from __future__ import annotations

from dataclasses import dataclass, field

from .priority import WriterPriority


@dataclass
class CheckpointerConfig:
    """Knobs of :class:`AsyncCheckpointer` (all but ``directory`` have defaults)."""

    directory: str
    """Folder holding ``step_XXXXXXXX`` checkpoints; shared by all ranks (created on first save)."""
    keep_last: int = 3
    """Committed checkpoints to keep; the newest committed one is never deleted."""
    write_bandwidth: float | None = None
    """Cap on each rank's write speed in bytes/s (storage simulation); None = unlimited."""
    verify: str = "full"
    """``latest_step``/``load`` verification: "full" (sizes + CRC32C) or "size" (sizes only)."""
    commit_timeout: float = 600.0
    """Seconds rank 0 waits in a blocking finalize for every rank to post its outcome (:mod:`.completion`)."""
    start_writer: bool = True
    """Spawn the writer at construction (hides its ~2 s start-up); False: at the first ``async_save``."""
    writer_priority: WriterPriority = field(default_factory=WriterPriority)
    """How the writer yields to training: nice, I/O class, cores (:mod:`.priority`)."""


def check_step(step) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
