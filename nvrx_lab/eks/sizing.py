"""A job's training state per GPU, by arithmetic (:mod:`nvrx_lab.sizing`): it sizes a pod's ``/dev/shm`` (the
async checkpoint's staging, the local checkpoints) and the launcher's ``checkpoint`` section (a blocking save at the
FSx file system's throughput), and :func:`check_model` refuses a job whose state does not fit a GPU or whose kept
checkpoints do not fit the FSx. A parameter is sharded over a group's GPUs (FSDP), or over a group's GPUs / N with
``--replicate N`` among the trainer's extra flags (HSDP); the GPUs compute in bf16."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, cast

from nvrx_lab.eks.instances import instance_type
from nvrx_lab.shapes import ModelConfig
from nvrx_lab.sizing import CHECKPOINT, StateSize, state_size

KEEP = 3
"""Checkpoints the trainer keeps on FSx (``--ckpt-keep``'s default; a test holds the two equal: the EKS layer does
not import the trainer)."""
GPU_SHARE = 0.8
"""Share of a GPU's memory the training state and what the model holds whole may take (the rest: activations at
activation checkpointing, NCCL's buffers, the allocator's slack)."""

if TYPE_CHECKING:
    from nvrx_lab.eks.spec import JobSpec
    from nvrx_lab.runner import LauncherConfig


def shards(s: JobSpec) -> int:
    """Ranks each parameter is sharded over."""
    return s.nodes * s.gpus // replicate(s.train_extra)


def sizing(s: JobSpec) -> StateSize:
    """One GPU's share of the training state (the async staging counted when ``ckpt='async'``)."""
    return _state_size(s.model, shards(s), s.ckpt_mode == "async")


def checkpointed_gib(s: JobSpec) -> float:
    """GiB one GPU checkpoints (its shard of the weights and AdamW's moments): what the async staging copies, and each
    local checkpoint holds."""
    return CHECKPOINT * sizing(s).parameters / shards(s) / 2**30


@functools.lru_cache(maxsize=64)
def _state_size(model: str, n: int, staged: bool) -> StateSize:
    return state_size(model_config(model), n, bf16=True, staged=staged)


def model_config(name: str) -> ModelConfig:
    """The preset ``name`` (a JobSpec's ``model``: any string) as a ``ModelConfig``, whose own check refuses a name that
    is no preset (``ValueError`` naming them): the type checker's ``Literal`` of names is what that check ensures."""
    return ModelConfig(preset=cast(Any, name))


def replicate(extra: tuple[str, ...]) -> int:
    """``--replicate N`` (or ``--replicate=N``) among the trainer's extra flags; 1 without it (the trainer checks N)."""
    for i, flag in enumerate(extra):
        value = flag.partition("=")[2] if flag.startswith("--replicate=") else \
            (extra[i + 1] if flag == "--replicate" and i + 1 < len(extra) else None)
        if value is not None:
            return int(value) if value.isdigit() and int(value) >= 1 else 1
    return 1


def save_seconds(s: JobSpec) -> float:
    """A whole checkpoint written at the FSx file system's provisioned throughput (capacity x MB/s per TiB)."""
    return sizing(s).checkpoint / (s.fsx_capacity_gib / 1024 * s.fsx_mbps_per_tib * 1e6)


SHORTEST_COLLECTIVE_TIMEOUT = 300.0
"""Seconds: a collective at NCCL's start-up on 16+ nodes (a communicator over EFA) takes well under it."""


def collective_timeout(s: JobSpec) -> float:
    """``--pg-timeout`` for a spec that sets none: a hang holds every node this long, so as short as the mode allows.
    Under the launcher at least its longest section timeout (a rank inside a section may keep the others waiting in a
    collective that long); with blocking saves (``ckpt='sync'``) at least the ``checkpoint`` section (every rank waits
    for the slowest writer); else :data:`SHORTEST_COLLECTIVE_TIMEOUT`."""
    sections = s.rendered_launcher.section_timeouts
    floor = max(sections.values(), default=0.0) if s.mode_info.uses_launcher else 0.0
    blocking = sections.get("checkpoint", 0.0) if s.ckpt_mode == "sync" else 0.0
    return max(SHORTEST_COLLECTIVE_TIMEOUT, floor, blocking)


def with_save_timeout(s: JobSpec) -> LauncherConfig:
    """``s.launcher``, whose ``checkpoint`` section, where it sets none, lasts twice :func:`save_seconds` in whole
    minutes and 600 s at least (600 s without checkpoints, or with a model the checks refuse)."""
    if "checkpoint" in s.launcher.section_timeouts:
        return s.launcher
    try:
        seconds = max(600, math.ceil(2 * save_seconds(s) / 60) * 60) if s.ckpt_mode != "none" else 600
    except (ValueError, TypeError, ZeroDivisionError):
        seconds = 600
    return dataclasses.replace(s.launcher, section_timeouts={**s.launcher.section_timeouts, "checkpoint": float(seconds)})


def check_model(s: JobSpec) -> None:
    """The preset exists, the data path is one every pod can read, and the state fits the GPUs."""
    try:
        model_config(s.model)
    except ValueError as e:
        _fail("model", str(e).removeprefix("--model "))
    if s.data and not s.data.startswith("/"):
        _fail("data", f"{s.data!r}; allowed: an absolute path every pod reads (under mount_path {s.mount_path!r}), or "
                      "empty for synthetic tokens")
    gpu_gb = instance_type(s.instance_type).gpu_gb
    size = s.sizing
    held = size.on_device
    room = GPU_SHARE * gpu_gb * 1e9
    if held > room:
        per_node = s.shards / s.nodes  # ranks a parameter is sharded over, per node
        least = math.ceil(size.parameters * 16 / per_node / (room - size.transient)) if room > size.transient else 0
        _fail("model", f"{s.model} over {s.shards} GPUs needs {held / 1e9:.3g} GB a GPU "
                       f"({(held - size.transient) / 1e9:.3g} GB of weights, gradients and AdamW, "
                       f"{size.transient / 1e9:.3g} GB while it computes): over {GPU_SHARE:.0%} of a {s.instance_type}'s "
                       f"{gpu_gb} GB GPU (the rest: activations, NCCL); allowed: "
                       + (f"nodes >= {least}" if least else "a type whose GPUs have more memory"))
    if s.ckpt_mode != "none" and (KEEP + 1) * size.checkpoint > s.fsx_capacity_gib * 2**30:
        need = math.ceil((KEEP + 1) * size.checkpoint / 2**30 / 2400) * 2400
        _fail("fsx_capacity_gib", f"{s.fsx_capacity_gib} GiB holds fewer than the trainer's {KEEP} kept checkpoints and "
                                  f"one being written ({size.checkpoint / 1e9:,.0f} GB each); allowed: >= {need}")


def _fail(field_name: str, problem: str) -> None:
    raise ValueError(f"JobSpec.{field_name}: {problem}")
