"""Process-group set-up shared by the trainer and the tools around it.

On GPUs the default group is NCCL and a second, gloo group carries CPU-side collectives
(checkpoint coordination, restart bookkeeping); on CPU one gloo group does both. A plain
``python -m nvrx_lab.train`` without torchrun runs as a world of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cpu_group: dist.ProcessGroup | None
    """Gloo group for CPU-side collectives (the default group itself on CPU)."""


def pick_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` takes this rank's GPU when CUDA is available, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False; use device='cpu' or 'auto'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device != "cpu":
        raise ValueError(f"device={device!r}; valid: auto, cpu, cuda")
    return torch.device("cpu")


def env_rank() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment, (0, 1, 0) without it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def init_distributed(device: str = "auto", timeout_s: float = 60.0) -> DistContext:
    """Initialise the default group from torchrun's environment (or a world of one) and the CPU group."""
    rank, world_size, local_rank = env_rank()
    dev = pick_device(device, local_rank)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None)
        else:  # a plain single process: a world of one on an in-memory store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return context_for(dev, timeout)


def context_for(dev: torch.device, timeout: timedelta | None = None) -> DistContext:
    """The context of an already initialised default group (e.g. one a restart wrapper created)."""
    _, _, local_rank = env_rank()
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if dev.type == "cuda" else dist.group.WORLD
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, dev, cpu_group)


def shutdown(ctx: DistContext | None = None, clean: bool = True) -> None:
    """Destroy the default group (and the CPU group); after a clean run, a barrier first.

    Why the barrier: torch 2.13's gloo worker threads outlive ``destroy_process_group`` and release a
    finished collective's work (and with it Python-owned tensors, which needs the GIL) a moment after
    the caller has moved on. If that moment falls in interpreter shutdown, the thread is killed while
    unwinding a destructor and the process aborts ("terminate called without an active exception",
    exit -6) after it has trained. A barrier runs after every earlier collective of the group has
    finished, so by then their work is released. After a failure no barrier: a peer may be gone."""
    if not dist.is_initialized():
        return
    if clean:
        group = ctx.cpu_group if ctx is not None else None
        dist.barrier(group=group)
        if group is not None and group is not dist.group.WORLD:
            dist.barrier()
    dist.destroy_process_group()
