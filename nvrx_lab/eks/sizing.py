"""A job's training state per GPU, by arithmetic (:mod:`nvrx_lab.train.sizing`): what sizes a pod's ``/dev/shm`` (the
async checkpoint's staging, the local checkpoints) and what :mod:`nvrx_lab.eks.checks` compares with a GPU's memory.
A parameter is sharded over a group's GPUs (FSDP), or over a group's GPUs / N with ``--replicate N`` among the
trainer's extra flags (HSDP); the GPUs compute in bf16."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from nvrx_lab.train.model import ModelConfig
from nvrx_lab.train.sizing import CHECKPOINT, StateSize, state_size

if TYPE_CHECKING:
    from nvrx_lab.eks.spec import JobSpec


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
    return state_size(ModelConfig(preset=model), n, bf16=True, staged=staged)


def replicate(extra: tuple[str, ...]) -> int:
    """``--replicate N`` (or ``--replicate=N``) among the trainer's extra flags; 1 without it (the trainer checks N)."""
    for i, flag in enumerate(extra):
        value = flag.partition("=")[2] if flag.startswith("--replicate=") else \
            (extra[i + 1] if flag == "--replicate" and i + 1 < len(extra) else None)
        if value is not None:
            return int(value) if value.isdigit() and int(value) >= 1 else 1
    return 1
