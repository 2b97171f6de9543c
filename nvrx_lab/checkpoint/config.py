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
    fork_writer: bool = True
    """Fork the writer from this process while no CUDA context exists here (ready in milliseconds); False, or
    once CUDA is initialised: a clean interpreter (~2 s to import torch). :mod:`.writer_main`."""
    announce: bool = True
    """One console line on rank 0 for what :meth:`~.AsyncCheckpointer.restore` did (the trainer says it itself)."""


    def __post_init__(self):
        from pathlib import Path

        from .throttle import check_bandwidth

        if Path(self.directory).exists() and not Path(self.directory).is_dir():
            raise NotADirectoryError(f"checkpoint directory {self.directory} is a file; pass a folder path")
        if self.verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {self.verify!r}")
        self.write_bandwidth = check_bandwidth(self.write_bandwidth, "write_bandwidth")


def check_step(step) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")


def check_initialised(directory, process_group) -> bool:
    """Whether ``torch.distributed`` is initialised (a checkpointer then coordinates over a group). Not
    initialised in a job of several ranks (``WORLD_SIZE`` > 1) is an error: every rank would save as rank
    0 of 1 into the same folder."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    if process_group is not None or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ValueError(f"AsyncCheckpointer({str(directory)!r}) made before torch.distributed.init_process_group in a "
                         f"job of WORLD_SIZE={os.environ.get('WORLD_SIZE')} ranks: every rank would save as rank 0 of 1. "
                         "Make it after init_process_group (under the in-process Wrapper: after "
                         "call_wrapper.init_process_group, or keep one across attempts and call rebind())")
    return False
