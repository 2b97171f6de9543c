"""Process-group set-up shared by the trainer and the tools around it.

On GPUs the default group is NCCL and a second, gloo group carries CPU-side collectives
(checkpoint coordination, restart bookkeeping); on CPU one gloo group does both. A plain
``python -m nvrx_lab.train`` without torchrun runs as a world of one.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun, ``nvrx_lab.launcher``, ``nvrx_lab.inprocess.spawn``, a Kubernetes pod) told this
    process, read from its environment once, where the process starts (:meth:`read`), then passed along."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    """Ranks on this node (the peer holding a rank's local replica is ``rank + local_world_size``)."""
    node: int = 0
    """This node's index (torchrun's ``GROUP_RANK``)."""
    restart_count: int = 0
    """The launcher's restarts of this worker group so far (``TORCHELASTIC_RESTART_COUNT``)."""
    master_addr: str = ""
    """Where rank 0's store listens (empty: a plain single process, a world of one)."""
    master_port: int = 0
    launcher_tolerates: int | None = None
    """Workers of this node ``nvrx_lab.launcher`` lets go without restarting the group (None: not under it)."""
    omp_threads: int | None = None
    """The CPU threads ``OMP_NUM_THREADS`` asks of each worker (None: unset): torchrun sets 1 for several workers a
    node, ``nvrx_lab.replicas.local`` 1 for every group's worker, the groups sharing one machine."""

    @property
    def launched(self) -> bool:
        """Started by a launcher (it set ``MASTER_ADDR``)."""
        return bool(self.master_addr)

    @classmethod
    def read(cls, environ: dict | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ
        num = lambda name, default: int(env.get(name) or default)  # noqa: E731
        return cls(num("RANK", 0), num("WORLD_SIZE", 1), num("LOCAL_RANK", 0), num("LOCAL_WORLD_SIZE", 1),
                   num("GROUP_RANK", 0), num("TORCHELASTIC_RESTART_COUNT", 0), env.get("MASTER_ADDR", ""),
                   num("MASTER_PORT", 0),
                   int(env["NVRX_LAB_LAUNCHER_TOLERATES"]) if env.get("NVRX_LAB_LAUNCHER_TOLERATES") else None,
                   int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit() else None)


def export_env(values: dict[str, str], keep_set: bool = False) -> None:
    """Settings torch and its libraries read from this process's environment (NCCL's error handling, cuBLAS's
    workspace), set where the process starts; ``keep_set``: a value the user set already stays."""
    for name, value in values.items():
        if not (keep_set and name in os.environ):
            os.environ[name] = value


def deterministic() -> None:
    """``torch.use_deterministic_algorithms(True)`` without its ``import torch._inductor.config``, which loads
    dynamo and inductor (~800 modules: 0.3-1 s of every worker start on 2 cores, a third of a warm restart);
    nvrx_lab compiles nothing. Inductor's own flag is set too when something loaded it."""
    torch._C._set_deterministic_algorithms(True, warn_only=False)
    if (inductor := sys.modules.get("torch._inductor.config")) is not None:
        inductor.deterministic = True


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process this one starts: its own, with ``extra`` on top."""
    return {**os.environ, **(extra or {})}


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cpu_group: dist.ProcessGroup | None
    """Gloo group for CPU-side collectives (the default group itself on CPU)."""
    launch: LaunchEnv = LaunchEnv()
    """What the launcher said (ranks per node, node index, restarts)."""


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


def init_distributed(launch: LaunchEnv, device: str = "auto", timeout_s: float = 60.0) -> DistContext:
    """Initialise the default group from the launcher's environment (or a world of one) and the CPU group."""
    dev = pick_device(device, launch.local_rank)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if launch.launched:  # torch reads MASTER_ADDR/PORT, RANK, WORLD_SIZE itself (env://)
            dist.init_process_group(backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None)
        else:  # a plain single process: a world of one on an in-memory store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return context_for(dev, launch, timeout)


def context_for(dev: torch.device, launch: LaunchEnv, timeout: timedelta | None = None) -> DistContext:
    """The context of an already initialised default group (e.g. one a restart wrapper created)."""
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if dev.type == "cuda" else dist.group.WORLD
    return DistContext(dist.get_rank(), dist.get_world_size(), launch.local_rank, dev, cpu_group, launch)


_meshes: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()
"""The meshes :func:`device_mesh` built, whose groups :func:`join_group_threads` lets go of."""


def device_mesh(device: torch.device, replicate: int = 1) -> DeviceMesh:
    """A mesh of every rank on ``device``'s type, remembered so that :func:`join_group_threads` can let go of its
    groups when the group is destroyed: 1-D (FSDP over every rank), or ``(replicate, world / replicate)`` with dims
    ``replicate`` and ``shard`` (HSDP: FSDP2 shards over the second and all-reduces over the first)."""
    world = dist.get_world_size()
    mesh = (init_device_mesh(device.type, (world,)) if replicate == 1 else
            init_device_mesh(device.type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")))
    _meshes.add(mesh)
    return mesh


def shutdown(ctx: DistContext | None = None, clean: bool = True) -> None:
    """Destroy the default group (and the CPU group); ``ctx`` no longer holds a group afterwards. After a clean
    run a barrier first, and their threads are joined after (:func:`join_group_threads`). After a failure
    neither: a peer may be gone, and a thread still in a collective with it would hold the exit up to the
    group's timeout."""
    if not dist.is_initialized():
        return
    if clean:
        group = ctx.cpu_group if ctx is not None else None
        dist.barrier(group=group)
        if group is not None and group is not dist.group.WORLD:
            dist.barrier()
    dist.destroy_process_group()
    if ctx is not None:
        ctx.cpu_group = None
    if clean:
        join_group_threads()


def join_group_threads() -> None:
    """After ``destroy_process_group``: let go of the destroyed groups, so that torch joins their threads now,
    while the interpreter is whole.

    torch 2.13's gloo worker threads release a finished work (and with it Python-owned tensors, which needs the
    GIL) a moment after the caller has moved on, and destroying the group does not join them: every
    ``DeviceMesh`` built over the group keeps it (``_pg_registry``, for torch.compile), and DTensor's sharding
    caches keep the meshes for the life of the process. If a thread's moment falls in interpreter shutdown, the
    thread is killed while unwinding a destructor and the process aborts ("terminate called without an active
    exception", exit -6) after it has trained; a barrier before the destroy narrows that window but cannot
    close it. Once its last reference goes, a group joins its threads (torch drops the GIL for that), so each
    one finishes its release first. Collecting garbage frees the FSDP modules' reference cycles that hold
    groups too."""
    for mesh in list(_meshes):
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    gc.collect()


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "NCCL communicator was aborted", "remote process exited or there was a network error")
"""What a collective raises on the survivors when a peer process dies (gloo's and NCCL's wording)."""


def peer_lost(error: BaseException) -> str | None:
    """The line that says a collective failed because a peer is gone (``None``: some other error). Such an
    error is the consequence of a fault elsewhere, not a fault: a launcher restarts the group either way."""
    text = str(error)
    if isinstance(error, RuntimeError) and any(p in text for p in PEER_LOST):
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        return f"a peer is gone ({first[:160]}): this rank stops too, for the restart"
    return None
