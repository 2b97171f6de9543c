"""Parameter fingerprints: the ledger says every row was trained once; these say the replicas hold one model.

Every ``--replica-fingerprint-every`` committed steps each rank reduces its shard of the parameters and of the
optimizer's state on its device, accumulating in float64 without a copy: per kind, the sum, the sum of squares and the
sum over even positions (which a permutation changes). It writes them as a ``fingerprint`` event. Rank ``k`` of every
replica holds the same shard, updated from the same reduced gradients by the same kernels, so the numbers agree
*exactly* across replicas (:func:`diverged`): a replacement that healed from a stale or partial state, or a member
that applied another update, shows here at the next fingerprint. A faulty run's equal a fault-free run's at the same
step up to rounding, since a redo sums the same rows in another order (:func:`nvrx_lab.replicas.ledger.fingerprint_gap`).

Cost on p5 (Llama 3.1 8B, FSDP over a node's 8 GPUs, fp32 state): 4 GB of parameters and 8 GB of Adam moments a
rank, read three times at ~3 TB/s of HBM: ~12 ms, and a 48-byte event; every 50 steps by default (0: never).
"""

from __future__ import annotations

import torch

from .step import local_tensor


def _sums(tensors: list[torch.Tensor]) -> list[float]:
    """Accumulated on each tensor's device, read once at the end (one synchronization, not one a tensor)."""
    acc: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for t in tensors:
            t = local_tensor(t).detach().reshape(-1)
            parts = torch.stack([t.sum(dtype=torch.float64), _square_sum(t), t[::2].sum(dtype=torch.float64)])
            acc[t.device] = acc[t.device] + parts if t.device in acc else parts
    return sum((a.cpu() for a in acc.values()), torch.zeros(3, dtype=torch.float64)).tolist()


def _square_sum(t: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """The sum of squares in float64, a chunk at a time (a float64 copy of a whole shard would double its memory)."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for part in t.split(chunk):
        total += (part.double() ** 2).sum()
    return total


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[float]]:
    """This rank's fingerprint: for its parameters and for its optimizer's state, [sum, sum of squares, even sum]."""
    params = [p for _, p in sorted(model.named_parameters())]
    names = {id(p): n for n, p in model.named_parameters()}
    state = [v for p in sorted(optimizer.state, key=lambda p: names.get(id(p), ""))
             for _, v in sorted(optimizer.state[p].items()) if isinstance(v, torch.Tensor)]
    return {"params": _sums(params), "optimizer": _sums(state)}
