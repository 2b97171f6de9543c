"""Training as one replica group of several (``--restart replicas``): the survivors of a fault never stop.

Each replica group is a torchrun job of its own (FSDP2 inside it); rank ``k`` of every group sums gradients with
rank ``k`` of the others over the quorum's cross-replica process group (:mod:`nvrx_lab.replicas.group`: gloo here,
NCCL on a GPU, made when the members change). Every step::

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
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nvrx_lab.faults import FaultInjector
from nvrx_lab.replicas.client import JobFinished, Refused, ReplicaClient, StateLost
from nvrx_lab.replicas.fingerprint import fingerprint
from nvrx_lab.replicas.group import StepAborted
from nvrx_lab.replicas.plane import Plane
from nvrx_lab.replicas.progress import Progress
from nvrx_lab.replicas.protocol import Quorum, StepShares, layout, rank_part
from nvrx_lab.train import runs
from nvrx_lab.train.config import TrainConfig
from nvrx_lab.train.data import SyntheticTokens
from nvrx_lab.train.hooks import Attempt
from nvrx_lab.train.state import TrainState, build_model

BUCKET_BYTES = 64 << 20
"""The most gradient bytes summed in one operation (one dtype a bucket); they are all issued at once."""


class ReplicaStep:
    """One rank's part of step ``step``: the rows it computed, their summed loss, the reduced gradients."""

    def __init__(self, cfg: TrainConfig, state: TrainState, attempt: Attempt, quorum: Quorum):
        self.cfg, self.state, self.attempt, self.step = cfg, state, attempt, quorum.step
        self.shares = StepShares(cfg.global_batch, quorum)
        self.params = [p for p in state.model.parameters() if p.requires_grad]
        self.rows: list[range] = []
        self.loss_sum = 0.0  # float64 from the rows on: sums over other partitions of the batch agree within 1e-12
        self.reduced: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def compute(self, rows: list[range]) -> None:
        """One forward and backward over ``rows`` of the step's global batch (gradients add up in ``.grad``). Always
        exactly one, even over no rows: FSDP's collectives inside the group must match on every rank."""
        batch = self.state.data.global_batch_at(self.step - 1)
        index = [r for rng in rows for r in rng]
        # no rows (a redo's few lost rows went to the other ranks): a stand-in row weighted zero, so this rank still
        # runs the forward and backward whose collectives its group's ranks run, and adds a zero gradient
        weight = 1.0 if index else 0.0
        toks = batch[torch.tensor(index or [0], dtype=torch.long)].to(self.attempt.device)
        logits = self.state.model(toks[:, :-1])
        per_row = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), toks[:, 1:].flatten(),
                                                    reduction="none").view(len(toks), -1).mean(1)
        (per_row.sum() * weight).backward()
        self.loss_sum += weight * float(per_row.detach().double().sum())
        self.rows += rows

    def buckets(self) -> list[torch.Tensor]:
        """This rank's gradient shards copied into buckets on the device, each of one dtype and at most
        :data:`BUCKET_BYTES` (copies: an aborted sum leaves ``.grad`` as computed, for the redo)."""
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in self.params]
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
        (buckets, loss), ranks = self.reduced, self.attempt.world_size
        loss = loss.cpu()
        if ranks > 1:
            dist.all_reduce(loss, group=self.attempt.cpu_group)
        rest, bucket, offset = iter(buckets[1:]), buckets[0], 0
        with torch.no_grad():
            for p in self.params:  # in the order buckets() packed them
                g = _local(p.grad)
                while offset + g.numel() > bucket.numel():
                    bucket, offset = next(rest), 0
                g.copy_(bucket[offset:offset + g.numel()].view_as(g)).mul_(ranks / self.cfg.global_batch)
                offset += g.numel()
        self.state.optimizer.step()
        self.state.optimizer.zero_grad(set_to_none=False)
        self.state.data.position = self.step
        return float(loss) / self.cfg.global_batch


def _local(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


def train_replica(cfg: TrainConfig, attempt: Attempt) -> dict:
    """One replica group's rank, from its first quorum to the last committed step; returns a summary. When the
    coordinator ends the job (every group failed before a replacement healed, or too few came), one error line and
    exit 1."""
    try:
        return _train(cfg, attempt)
    except Refused as e:  # another nvrx_lab than the coordinator's: a usage error, which no restart mends
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except StateLost as e:
        print(f"[nvrx_lab.replicas] error: replica {cfg.replicas.replica_id} rank {attempt.rank}: {e}", file=sys.stderr,
              flush=True)
        raise SystemExit(1) from None


def _start(cfg: TrainConfig, attempt: Attempt) -> tuple[ReplicaClient, TrainState, Progress, Plane, FaultInjector | None]:
    """Connect to the coordinator and build the state (a replacement warms up off the others' critical path); group
    rank 0 joins: the first join says the gradients' layout, so a group of another model is refused, not summed."""
    rc, rank, ranks = cfg.replicas, attempt.rank, attempt.world_size
    client = ReplicaClient(*rc.address, rc.replica_id, rank, ranks, reconnect_timeout=rc.reconnect_timeout)
    state = _state(cfg, attempt)
    client.progress = progress = Progress(state.model, state.optimizer, attempt.device, rc.hang_timeout)
    plane = Plane(client, state, attempt, rc, progress)
    faults = cfg.faults.faults
    injector = FaultInjector(faults, rc.replica_id * ranks + rank, state_file=runs.fault_state_file(cfg),
                             emit=attempt.events.emit) if faults else None
    if client.healing:
        _warm_up(cfg, state, attempt)
    if rank == 0:
        client.join(step=0 if client.healing else 1, done=None,
                    layout=layout(dict(state.model.named_parameters()), ranks, global_batch=cfg.global_batch,
                                  seq_len=cfg.model.seq_len))
    return client, state, progress, plane, injector


def _train(cfg: TrainConfig, attempt: Attempt) -> dict:
    rc, events, rank, ranks = cfg.replicas, attempt.events, attempt.rank, attempt.world_size
    client, state, progress, plane, injector = _start(cfg, attempt)
    try:
        quorum, group, work = client.next_quorum(), None, None
    except JobFinished as e:
        print(f"[rank {attempt.rank}] replica {rc.replica_id}: {e}; exiting", flush=True)
        return {"steps": e.step or 0, "losses": [], "world_size": ranks}
    try:
        losses, periods, last = [], [], time.monotonic()
        while True:
            joiner = rc.replica_id in quorum.joiners  # it heals: what it computed before is not this job's state
            if quorum.committed is not None and work is not None and work.step == quorum.committed and not joiner:
                with progress.working():
                    losses.append(work.apply())
                state.step = client.position.committed = quorum.committed
                now = time.monotonic()
                periods.append(now - last)
                last = now
                if rank == 0:
                    events.emit("step", step=state.step, loss=losses[-1], step_time=periods[-1], replica=rc.replica_id,
                                members=len(quorum.members))
                if rc.fingerprint_every and state.step % rc.fingerprint_every == 0:
                    events.emit("fingerprint", step=state.step, replica=rc.replica_id,
                                **fingerprint(state.model, state.optimizer))
                work = None
            if quorum.resumed or joiner:  # a restarted coordinator: a step computed, not committed, is computed again
                if quorum.resumed:
                    plane.resume(quorum, group)
                    group = None
                work = None
                state.optimizer.zero_grad(set_to_none=False)
            if quorum.step > cfg.steps:
                break
            done = None
            group, ready = plane.meet(quorum, group, events)
            # every member computes, ready or not: the table of who holds which rows must be the same everywhere
            with progress.working():  # the probe judges a gap here (.progress): hung, or only slow
                work = _work(work, cfg, state, attempt, quorum, injector)
            if ready:
                try:
                    done = plane.reduce(work, group, quorum, periods)
                    progress.step_finished()
                    events.emit("ledger", step=work.step, qid=quorum.qid, replica=rc.replica_id,
                                rows=[[r.start, r.stop] for r in work.rows])
                except (StepAborted, RuntimeError):  # RuntimeError: the heal's ring broke (a member failed meanwhile)
                    done = None
            done = _agree(done, attempt)
            if rank == 0:
                client.join(step=quorum.step + 1 if done is not None else quorum.step, done=done)
            quorum = client.next_quorum()
    except Exception as e:  # this replica fails: the others hear it now, not when its process has exited
        client.fail(f"{type(e).__name__}: {e}")
        raise
    client.bye()
    return {"steps": state.step, "losses": losses, "world_size": ranks}


def _work(work: ReplicaStep | None, cfg: TrainConfig, state: TrainState, attempt: Attempt, quorum: Quorum,
          injector: FaultInjector | None) -> ReplicaStep:
    """This rank's gradients for the quorum's step: its share of a fresh step, or of the rows the members that
    left held when the step is redone."""
    replica, rank, ranks = cfg.replicas.replica_id, attempt.rank, attempt.world_size
    if work is None or work.step != quorum.step:
        work = ReplicaStep(cfg, state, attempt, quorum)
        if injector is not None:
            injector.catch_up(quorum.step)
        work.compute(rank_part(work.shares.rows(replica), rank, ranks))
    else:
        work.compute(rank_part(work.shares.redo(quorum)[replica], rank, ranks))
    return work


def _warm_up(cfg: TrainConfig, state: TrainState, attempt: Attempt) -> None:
    """A replacement pays its first step's one-off costs before it joins, not while the others wait for it: the
    optimizer's state made (the heal copies into it in place) and one forward and backward over a row of its own
    random weights (autograd's and FSDP's first-call setup), its gradients then zeroed."""
    state.local_state_dict()
    toks = state.data.global_batch_at(0)[:1].to(attempt.device)
    logits = state.model(toks[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), toks[:, 1:].flatten()).backward()
    state.optimizer.zero_grad(set_to_none=False)


def _agree(done: int | None, attempt: Attempt) -> int | None:
    """The group finished the step only if every one of its ranks did."""
    if attempt.world_size == 1:
        return done
    flag = torch.tensor([1 if done is not None else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=attempt.cpu_group)
    return done if flag.item() else None


def _state(cfg: TrainConfig, attempt: Attempt) -> TrainState:
    model = build_model(cfg, attempt.device)  # FSDP averages a group's gradients over its ranks (apply undoes it)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_len, cfg.global_batch, seed=cfg.seed)
    return TrainState(model, optimizer, data)
