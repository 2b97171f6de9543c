"""One rank's part of one step: the rows it computed, their summed loss, its gradients in buckets, the update."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .protocol import Quorum, StepShares, rank_part

if TYPE_CHECKING:
    from .loop import Group

BUCKET_BYTES = 64 << 20
"""The most gradient bytes summed in one operation (one dtype a bucket); they are all issued at once."""


class ReplicaStep:
    """One rank's part of step ``step``: the rows it computed, their summed loss, the reduced gradients."""

    def __init__(self, state, group: Group, quorum: Quorum, global_batch: int,
                 compute: Callable[[int, list[int]], float]):
        self.state, self.group, self.step, self.global_batch = state, group, quorum.step, global_batch
        self._compute = compute
        self.shares = StepShares(global_batch, quorum)
        self.params = [p for p in state.model.parameters() if p.requires_grad]
        self.rows: list[range] = []
        self.loss_sum = 0.0  # float64 from the rows on: sums over other partitions of the batch agree within 1e-12
        self.reduced: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def compute(self, share: list[range]) -> None:
        """This rank's part of ``share`` (its group's rows), one forward and backward over it (gradients add up in
        ``.grad``); always exactly one call, even over no rows: FSDP's collectives inside the group must match."""
        mine = rank_part(share, self.group.rank, self.group.world_size)
        self.loss_sum += self._compute(self.step, [r for rng in mine for r in rng])
        self.rows += mine

    def buckets(self) -> list[torch.Tensor]:
        """This rank's gradient shards copied into buckets on the device, each of one dtype and at most
        :data:`BUCKET_BYTES` (copies: an aborted sum leaves ``.grad`` as computed, for the redo)."""
        grads = [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p)) for p in self.params]
        out: list[list[torch.Tensor]] = []
        size = 0  # bytes in the last bucket
        for g in grads:
            if not out or out[-1][0].dtype != g.dtype or size + g.nbytes > BUCKET_BYTES:
                out.append([])
                size = 0
            out[-1].append(g.reshape(-1))
            size += g.nbytes
        return [torch.cat(b) for b in out]

    def apply(self) -> float:
        """The committed update: gradients = the sum over every row of the batch / global batch (FSDP's reduction
        inside a group averaged over its ranks: times ranks); returns the step's loss (summed over the group's ranks,
        which each hold the loss of their own rows)."""
        (buckets, loss), ranks = self.reduced, self.group.world_size
        loss = loss.cpu()
        if ranks > 1:
            dist.all_reduce(loss, group=self.group.cpu_group)
        rest, bucket, offset = iter(buckets[1:]), buckets[0], 0
        with torch.no_grad():
            for p in self.params:  # in the order buckets() packed them
                g = local_tensor(p.grad)
                while offset + g.numel() > bucket.numel():
                    bucket, offset = next(rest), 0
                g.copy_(bucket[offset:offset + g.numel()].view_as(g)).mul_(ranks / self.global_batch)
                offset += g.numel()
        self.state.optimizer.step()
        self.state.optimizer.zero_grad(set_to_none=False)
        self.state.data.position = self.step
        return float(loss) / self.global_batch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a DTensor's local tensor, read without autograd), or ``t`` itself."""
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t
