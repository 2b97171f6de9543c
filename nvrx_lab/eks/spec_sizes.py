"""The sizes a :class:`~nvrx_lab.eks.spec.JobSpec` derives from its model and instance type: shards, checkpointed
state, ``/dev/shm``, CPU and memory (:mod:`nvrx_lab.eks.sizing` does the arithmetic)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

from nvrx_lab.eks import sizing
from nvrx_lab.eks.instances import pod_resources
from nvrx_lab.runner import LauncherConfig
from nvrx_lab.sizing import StateSize

if TYPE_CHECKING:
    from nvrx_lab.eks.spec import JobSpec


class Sizes:
    """Mixed into ``JobSpec``: its derived sizes, read by the renderer, never the raw optional fields."""

    @property
    def _spec(self) -> JobSpec:
        """``self``: ``JobSpec`` is the one class this is mixed into (its fields are what the sizes read)."""
        return cast("JobSpec", self)

    @property
    def shards(self) -> int:
        return sizing.shards(self._spec)

    @property
    def sizing(self) -> StateSize:
        return sizing.sizing(self._spec)

    @property
    def state_gib_per_gpu(self) -> float:
        return sizing.checkpointed_gib(self._spec)

    @property
    def collective_timeout(self) -> float:
        s = self._spec
        return s.pg_timeout if s.pg_timeout is not None else sizing.collective_timeout(s)

    @property
    def rendered_launcher(self) -> LauncherConfig:
        """``launcher`` as rendered: a ``checkpoint`` section it does not set lasts twice a blocking save (600 s at least)."""
        return sizing.with_save_timeout(self._spec)

    @property
    def staging_gib(self) -> int:
        """``/dev/shm`` for the async checkpoint's staging copy: one per GPU (a sync save writes the live tensors)."""
        s = self._spec
        return math.ceil(s.state_gib_per_gpu * s.gpus) if s.ckpt_mode == "async" else 0

    @property
    def local_copies_gib(self) -> int:
        """Room for the local checkpoints: ``local_ckpt_gib``, else 4 x a GPU's checkpointed state x GPUs (0: off)."""
        s = self._spec
        if not s.local_ckpt_interval:
            return 0
        return s.local_ckpt_gib or math.ceil(4 * s.state_gib_per_gpu * s.gpus)

    @property
    def shm(self) -> int:
        """The memory-backed ``/dev/shm``'s size limit in GiB: NCCL's and dataloaders', the staging copy, and the local
        checkpoints unless they are on NVMe."""
        s = self._spec
        base = s.shm_gib or max(1, min(64, s.cpu_memory[1] // 4))
        return base + s.staging_gib + (0 if s.local_ckpt_on_nvme else s.local_copies_gib)

    @property
    def cpu_memory(self) -> tuple[int, int]:
        return pod_resources(self._spec.instance)
