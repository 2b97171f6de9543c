"""Replica groups in a script of one's own (:mod:`nvrx_lab.replicas.loop`): a model, a data function, a loss; the
loop brings the quorum, the commit, the heal and the redo.

::

    python -m nvrx_lab.replicas.local --replicas 3 --nproc 2 --worker nvrx_lab.demo.replica_worker -- \\
        --steps 12 --global-batch 6 --faults 2:4:sigkill

Each group (a torchrun job) shards a small regression model over its ranks with FSDP2. Row ``i`` of step ``s`` is a
pure function of ``(s, i)``, so a redo reads the very rows a lost group held. Rank 0 of group 1 is killed in step 4
above: the survivors redo step 4 with its rows, its torchrun starts a replacement, which heals from a live group and
joins; replicas.local prints the ledger (every row of every committed step exactly once).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from nvrx_lab.faults import FaultInjector, parse_schedule
from nvrx_lab.observe.events import EventLog
from nvrx_lab.replicas.config import ReplicaConfig
from nvrx_lab.replicas.loop import Group, ReplicaLoop, replica_state

DIM = 32


def batch(step: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows`` of step ``step``'s global batch: inputs and targets of a fixed linear map, plus noise."""
    x = torch.stack([torch.randn(DIM, generator=torch.Generator().manual_seed(step * 100_003 + i)) for i in rows])
    w = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(7))
    return x, x @ w


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.demo.replica_worker", allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=6)
    ap.add_argument("--faults", default="", help="RANK:STEP:KIND,... (rank = replica id x ranks + rank)")
    ap.add_argument("--metrics", default=None, help="this group's event stream (the ledger reads it)")
    ap.add_argument("--restart", default="replicas")  # what replicas.local passes every worker; nothing else here
    a, rest = ap.parse_known_args(argv)
    config = ReplicaConfig.from_args(rest, prog=ap.prog)  # --coordinator, --replica-id, --replicas, --replica-*
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    events = EventLog(a.metrics, rank=rank)

    torch.manual_seed(0)  # every group starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, DIM))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)  # FSDP averages the group's gradients over its ranks; the loop takes that into account
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def compute(step: int, rows: list[int]) -> float:
        x, y = batch(step, rows or [0])  # no rows: a stand-in row weighted zero (the FSDP collectives must match)
        loss = ((model(x) - y) ** 2).mean(dim=1).sum() * (1.0 if rows else 0.0)
        loss.backward()
        return float(loss)

    faults = FaultInjector(parse_schedule(a.faults), config.replica_id * ranks + rank,
                           state_file=f"{a.metrics}.faults" if a.metrics else None, emit=events.emit)
    loop = ReplicaLoop(replica_state(model, optimizer), compute, config, Group.of_torchrun(torch.device("cpu"), events.emit),
                       steps=a.steps, global_batch=a.global_batch, before_step=faults.catch_up)
    summary = loop.run()
    if rank == 0:
        print(f"replica {config.replica_id}: trained to step {summary['steps']}, last loss "
              f"{summary['losses'][-1] if summary['losses'] else float('nan'):.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
