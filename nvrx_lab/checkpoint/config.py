"""The knobs of :class:`~nvrx_lab.checkpoint.AsyncCheckpointer`, one field each with its docs.

The same object is the storage part of the trainer's ``--ckpt-*`` flags (:class:`~.manager.CheckpointConfig`):
a field's ``metadata["flag"]`` names its flag there (``None``: an API knob only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nvrx_lab.cli import Settings

from .priority import WriterPriority

NO_FLAG = {"flag": None}


@dataclass
class CheckpointerConfig(Settings):
    """Knobs of :class:`AsyncCheckpointer`."""

    directory: str = field(default="", metadata={"flag": "ckpt-dir"})
    """Folder of the checkpoints (shared by all ranks, created on the first save); a run resumes from its newest
    committed checkpoint."""
    keep_last: int = field(default=3, metadata={"flag": "ckpt-keep"})
    """Committed checkpoints to keep; the newest committed one is never deleted."""
    write_bandwidth: float = field(default=0.0, metadata={"flag": "ckpt-write-bandwidth"})
    """Cap on each rank's write speed in bytes/s, a stand-in for a loaded shared filesystem (0 = no cap)."""
    writer_priority: WriterPriority = field(default_factory=WriterPriority, metadata={"flag_prefix": "ckpt-writer-"})
    """How the writer yields to training: nice, I/O class, cores (:mod:`.priority`)."""
    verify: str = field(default="full", metadata=NO_FLAG)
    """``latest_step``/``load`` verification: "full" (sizes + CRC32C) or "size" (sizes only)."""
    commit_timeout: float = field(default=600.0, metadata=NO_FLAG)
    """Seconds rank 0 waits in a blocking finalize for every rank to post its outcome (:mod:`.completion`)."""
    start_writer: bool = field(default=True, metadata=NO_FLAG)
    """Start the writer at construction (it is ready before the first save); False: at the first ``async_save``."""
    fork_writer: bool = field(default=True, metadata=NO_FLAG)
    """Fork the writer from this process while no CUDA context exists here (ready in milliseconds); False, or
    once CUDA is initialised: a clean interpreter (~2 s to import torch). :mod:`.writer_main`."""
    announce: bool = field(default=True, metadata=NO_FLAG)
    """One console line on rank 0 for what :meth:`~.AsyncCheckpointer.restore` did (the trainer says it itself)."""

    def __post_init__(self):
        from pathlib import Path

        from .throttle import check_bandwidth

        if self.directory and Path(self.directory).exists() and not Path(self.directory).is_dir():
            raise ValueError(f"--ckpt-dir (directory) {self.directory} is a file; pass a folder path")
        if self.verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {self.verify!r}")
        if self.keep_last < 1:
            raise ValueError(f"--ckpt-keep (keep_last) must be >= 1, got {self.keep_last}")
        self.write_bandwidth = check_bandwidth(self.write_bandwidth, "--ckpt-write-bandwidth (write_bandwidth)") or 0.0


def check_step(step) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")


def check_initialised(directory, process_group) -> bool:
    """Whether ``torch.distributed`` is initialised (a checkpointer then coordinates over a group). Not
    initialised in a job a launcher started (torch's ``is_torchelastic_launched``: torchrun, nvrx_lab.launcher)
    is an error: every rank would save as rank 0 of 1 into the same folder."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    if process_group is not None or dist.is_torchelastic_launched():
        raise ValueError(f"AsyncCheckpointer({str(directory)!r}) made before torch.distributed.init_process_group in a "
                         "job a launcher started: every rank would save as rank 0 of 1. "
                         "Make it after init_process_group (under the in-process Wrapper: after "
                         "call_wrapper.init_process_group, or keep one across attempts and call rebind())")
    return False
