"""The sizes a :class:`~nvrx_lab.eks.spec.JobSpec` derives from its model and instance type: shards, checkpointed
state, ``/dev/shm``, CPU and memory (:mod:`nvrx_lab.eks.sizing` does the arithmetic)."""

from __future__ import annotations

import math

from nvrx_lab.eks import sizing
from nvrx_lab.eks.instances import pod_resources
from nvrx_lab.runner import LauncherConfig
from nvrx_lab.sizing import StateSize


class Sizes:
    """Mixed into ``JobSpec``: its derived sizes, read by the renderer, never the raw optional fields."""

    @property
    def shards(self) -> int:
        return sizing.shards(self)

    @property
    def sizing(self) -> StateSize:
        return sizing.sizing(self)

    @property
    def state_gib_per_gpu(self) -> float:
        return sizing.checkpointed_gib(self)

    @property
    def collective_timeout(self) -> float:
        return self.pg_timeout if self.pg_timeout is not None else sizing.collective_timeout(self)

    @property
    def rendered_launcher(self) -> LauncherConfig:
        """``launcher`` as rendered: a ``checkpoint`` section it does not set lasts twice a blocking save (600 s at least)."""
        return sizing.with_save_timeout(self)

    @property
    def staging_gib(self) -> int:
        """``/dev/shm`` for the async checkpoint's staging copy: one per GPU (a sync save writes the live tensors)."""
        return math.ceil(self.state_gib_per_gpu * self.gpus) if self.ckpt_mode == "async" else 0

    @property
    def local_copies_gib(self) -> int:
        """Room for the local checkpoints: ``local_ckpt_gib``, else 4 x a GPU's checkpointed state x GPUs (0: off)."""
        if not self.local_ckpt_interval:
            return 0
        return self.local_ckpt_gib or math.ceil(4 * self.state_gib_per_gpu * self.gpus)

    @property
    def shm(self) -> int:
        """The memory-backed ``/dev/shm``'s size limit in GiB: NCCL's and dataloaders', the staging copy, and the local
        checkpoints unless they are on NVMe."""
        base = self.shm_gib or max(1, min(64, self.cpu_memory[1] // 4))
        return base + self.staging_gib + (0 if self.local_ckpt_on_nvme else self.local_copies_gib)

    @property
    def cpu_memory(self) -> tuple[int, int]:
        return pod_resources(self.instance)
