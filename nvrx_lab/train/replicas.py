"""Training as one replica group of several (``--restart replicas``): the survivors of a fault never stop.

Each replica group is a torchrun job of its own (FSDP2 inside it); rank ``k`` of every group sums gradients with
rank ``k`` of the others over the quorum's cross-replica process group (:mod:`nvrx_lab.replicas.group`: gloo here,
NCCL on a GPU, made when the members change). The loop is :class:`nvrx_lab.replicas.loop.ReplicaLoop`, which a script
of one's own runs the same way; this module gives it the trainer's model, data, checkpoints and faults. Every step::

    quorum  = the coordinator's answer to "ready for step s" (group rank 0 asks; every rank hears)
    commit  the previous step's update if every member finished it (quorum.committed)
    heal    a replacement gets a live member's state (rank k from rank k) before it trains (it made its optimizer's
            state and ran one forward and backward before it joined: the others do not wait for its first-call costs)
    compute this rank's rows of step s's global batch: its replica's share, split among the group's ranks
    reduce  the gradients' sum over the members, in buckets on the device in their dtype (StepAborted if a member
            fails meanwhile)

After an abort the same step is redone by the survivors: each keeps the gradients of the rows it computed and
takes its part of the rows the lost member held (:class:`~nvrx_lab.replicas.protocol.StepShares`), so the
global batch stays what ``--global-batch`` says and every row is trained exactly once: every committed step
writes each rank's rows to the ``ledger`` event. Losses are sums over rows divided by the global batch, so the
loss curve is the fault-free one up to the order of the sums.
"""

from __future__ import annotations

import sys
import time

import torch

from nvrx_lab.checkpoint import Checkpointer
from nvrx_lab.faults import FaultInjector
from nvrx_lab.replicas.client import Refused, StateLost
from nvrx_lab.replicas.loop import Compute, Group, ReplicaLoop
from nvrx_lab.train import runs
from nvrx_lab.train.config import TrainConfig
from nvrx_lab.train.data import token_source
from nvrx_lab.train.hooks import Attempt
from nvrx_lab.train.state import TrainState, build_model


def train_replica(cfg: TrainConfig, attempt: Attempt, ckpt: Checkpointer | None = None) -> dict:
    """One replica group's rank, from its first quorum to the last committed step; returns a summary. When the
    coordinator ends the job (every group failed before a replacement healed, or too few came), one error line and
    exit 1. With storage checkpoints (``ckpt``), the lowest live replica saves every ``--ckpt-interval`` committed
    steps, and a group that starts a job (or goes on after every group failed) restores the newest."""
    try:
        return _loop(cfg, attempt, ckpt).run()
    except Refused as e:  # another nvrx_lab than the coordinator's: a usage error, which no restart mends
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except StateLost as e:
        print(f"[nvrx_lab.replicas] error: replica {cfg.replicas.replica_id} rank {attempt.rank}: {e}", file=sys.stderr,
              flush=True)
        raise SystemExit(1) from None


def _loop(cfg: TrainConfig, attempt: Attempt, ckpt: Checkpointer | None) -> ReplicaLoop:
    """The loop over the trainer's state, data and faults: a replacement warms up off the others' critical path, a
    founder restores the newest storage checkpoint, if any."""
    rc, rank, ranks = cfg.replicas, attempt.rank, attempt.world_size
    state = _state(cfg, attempt)
    group = Group(rank, ranks, attempt.device, attempt.cpu_group, attempt.events.emit)
    faults = cfg.faults.faults
    injector = FaultInjector(faults, rc.replica_id * ranks + rank, state_file=runs.fault_state_file(cfg),
                             emit=attempt.events.emit) if faults else None
    per_row = cfg.step_sleep / max(1, cfg.global_batch // (rc.replicas * ranks))  # --step-sleep for a rank's nominal rows
    loop = ReplicaLoop(state, _compute(state, attempt.device, per_row), rc, group, steps=cfg.steps, global_batch=cfg.global_batch,
                       ckpt=ckpt, before_step=injector.catch_up if injector else None,
                       settings={"seq_len": cfg.model.seq_len, "data": cfg.data or "synthetic", "seed": cfg.seed},
                       sample_ids=lambda step: state.data.sample_ids(step - 1))
    if loop.healing:
        _warm_up(state, attempt)
    elif ckpt is not None:
        restored, where = ckpt.restore(state), cfg.checkpoint.storage.directory
        if restored is not None:
            state.step = state.data.position = loop.client.position.committed = restored.step
        if rank == 0:
            print(f"[nvrx_lab.replicas] RESUME replica {rc.replica_id} at step {restored.step} from the storage "
                  f"checkpoint in {where}; it founds a new first quorum with the groups that restored it too"
                  if restored is not None else
                  f"[nvrx_lab.replicas] START replica {rc.replica_id} at step 1: no storage checkpoint in {where} yet",
                  flush=True)
    return loop


def _compute(state: TrainState, device: torch.device, sleep_per_row: float = 0.0) -> Compute:
    """The trainer's forward and backward over rows of a step's synthetic global batch; ``sleep_per_row``: the
    ``--step-sleep`` stand-in for a bigger model's compute, in proportion to the rows (a redo's extra rows cost more)."""
    def compute(step: int, rows: list[int]) -> float:
        batch = state.data.global_batch_at(step - 1)
        # no rows (a redo's few lost rows went to the other ranks): a stand-in row weighted zero, so this rank still
        # runs the forward and backward whose collectives its group's ranks run, and adds a zero gradient
        weight = 1.0 if rows else 0.0
        toks = batch[torch.tensor(rows or [0], dtype=torch.long)].to(device)
        logits = state.model(toks[:, :-1])
        per_row = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), toks[:, 1:].flatten(),
                                                    reduction="none").view(len(toks), -1).mean(1)
        (per_row.sum() * weight).backward()
        if sleep_per_row and rows:
            time.sleep(sleep_per_row * len(rows))
        return weight * float(per_row.detach().double().sum())

    return compute


def _warm_up(state: TrainState, attempt: Attempt) -> None:
    """A replacement pays its first step's one-off costs before it joins, not while the others wait for it: the
    optimizer's state made (the heal copies into it in place) and one forward and backward over a row of its own
    random weights (autograd's and FSDP's first-call setup), its gradients then zeroed."""
    state.local_state_dict()
    toks = state.data.global_batch_at(0)[:1].to(attempt.device)
    logits = state.model(toks[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), toks[:, 1:].flatten()).backward()
    state.optimizer.zero_grad(set_to_none=False)


def _state(cfg: TrainConfig, attempt: Attempt) -> TrainState:
    model = build_model(cfg, attempt.device)  # FSDP averages a group's gradients over its ranks (apply undoes it)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = token_source(cfg)
    return TrainState(model, optimizer, data)
