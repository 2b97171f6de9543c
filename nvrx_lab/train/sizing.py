"""The trainer's side of :mod:`nvrx_lab.sizing`: rank 0's ``MODEL`` line at start and each rank's ``memory`` event
(the arithmetic's estimate beside its measured peak resident memory and, on a GPU, its peak allocation)."""

from __future__ import annotations

from nvrx_lab.sizing import state_size
from nvrx_lab.train.state import precision


def resident_bytes() -> tuple[int, int]:
    """This process's resident memory now and at its peak, in bytes (Linux: ``/proc/self/status``)."""
    now = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                now = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return now, peak


class Sizer:
    """The trainer's view: the ``MODEL`` line on rank 0 at a launch's first attempt, and at the end a ``memory`` event
    with what the arithmetic said and what the rank measured (its peak resident memory above what it held before
    the model was built, and the device's peak allocation on a GPU)."""

    def __init__(self, cfg, attempt):
        import torch

        self.attempt = attempt
        bf16 = precision(cfg, attempt.device) == "bf16"
        self.size = state_size(cfg.model, attempt.world_size // cfg.replicate, bf16, cfg.checkpoint.mode == "async")
        self.before = resident_bytes()[0]
        if attempt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(attempt.device)
        if attempt.rank == 0 and attempt.first_start:
            print(f"[nvrx_lab] {self.size.line(cfg.model.preset, attempt.world_size)}", flush=True)

    def measured(self) -> None:
        import torch

        peak = resident_bytes()[1]
        device = torch.cuda.max_memory_allocated(self.attempt.device) if self.attempt.device.type == "cuda" else None
        self.attempt.events.emit("memory", rank=self.attempt.rank, estimated_state=self.size.state,
                                 estimated_peak=self.size.peak, rss_before=self.before, rss_peak=peak,
                                 device_peak=device)
