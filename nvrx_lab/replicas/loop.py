"""Replica groups in a training loop of one's own: :class:`ReplicaLoop`.

A replica group is a torchrun job whose ranks shard one copy of the model (FSDP inside the group); the job's R groups
train the same steps, and rank ``k`` of each sums its gradients with rank ``k`` of the others every step. Your script,
run by each group's torchrun, gives three things and the loop does the rest::

    state = replica_state(model, optimizer)          # your FSDP model and its optimizer (what a replacement heals)

    def compute(step: int, rows: list[int]) -> float:
        tokens = my_batch(step)[rows or [0]]         # rows of step's global batch (0..global_batch-1): yours to read
        loss = loss_fn(model(tokens)).sum() * (1.0 if rows else 0.0)  # summed over rows; no rows: a stand-in row
        loss.backward()                              # weighted zero: once a call, FSDP's collectives must match
        return float(loss)

    config = ReplicaConfig(coordinator="coord:29600", replica_id=r, replicas=3)   # or TrainConfig's --replica* flags
    summary = ReplicaLoop(state, compute, config, Group.of_torchrun(device), steps=1000, global_batch=96).run()

Every step, in this order: the coordinator's **quorum** for step ``s`` (group rank 0 asks; every rank hears); the
**commit** of step ``s - 1`` if every member finished it (the optimizer steps on the sum of every row of the global
batch ÷ global batch); a replacement's **heal** (rank ``k`` of a live group sends its state to rank ``k`` of the new
one); ``compute(s, rows)`` over this rank's **share** of the batch (its group's share of the quorum, split among the
group's ranks: :func:`~.protocol.rank_part`); the gradients' **sum** over the members. When a member fails meanwhile,
the sum is aborted and the survivors call ``compute(s, more_rows)`` with the rows the lost member held, adding to the
gradients they kept: the same step, the whole global batch, every row once (``ledger`` events say which).

``nvrx_lab.demo.replica_worker`` is this, end to end (``python -m nvrx_lab.replicas.local --worker``); the trainer
(:mod:`nvrx_lab.train.replicas`) runs the same loop with its data, checkpoints and injected faults.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .client import JobFinished, ReplicaClient
from .config import ReplicaConfig
from .fingerprint import fingerprint
from .group import StepAborted
from .plane import Plane
from .progress import Progress
from .protocol import Quorum, layout
from .step import ReplicaStep

Compute = Callable[[int, list[int]], float]
"""``compute(step, rows)``: forward and backward over ``rows`` of step ``step``'s global batch, gradients added to
``.grad``; returns the loss summed over those rows."""


@dataclass
class Group:
    """Where this rank sits in its replica group (its torchrun job)."""

    rank: int
    world_size: int
    device: torch.device
    cpu_group: dist.ProcessGroup | None = None
    """A gloo group of the group's ranks for the step's small agreements (the default group on CPU)."""
    emit: Callable[..., None] = field(default=lambda kind, **fields: None)
    """Where the loop's events go (``nvrx_lab.observe.events.EventLog.emit``): steps, ``ledger``, heals."""

    @classmethod
    def of_torchrun(cls, device: torch.device, emit: Callable[..., None] | None = None) -> Group:
        """This process in torch's default group (``dist.init_process_group`` done): on a GPU a gloo group beside it."""
        cpu = dist.group.WORLD if device.type == "cpu" else dist.new_group(backend="gloo")
        return cls(dist.get_rank(), dist.get_world_size(), device, cpu, emit or (lambda kind, **fields: None))


class StepPosition:
    """A loop's data state when the data is addressed by step: the last step trained (what a heal carries)."""

    position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])


def replica_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any = None):
    """The state a replacement heals (and a storage checkpoint saves): ``model``, ``optimizer``, ``data`` (by default
    :class:`StepPosition`) and the step (:class:`~nvrx_lab.train.state.TrainState`)."""
    from nvrx_lab.train.state import TrainState

    return TrainState(model, optimizer, data if data is not None else StepPosition())


class ReplicaLoop:
    """Training ``steps`` steps of ``global_batch`` rows as one replica group of several (see the module's docs)."""

    OPTIONS = ("ckpt", "before_step", "settings", "sample_ids")

    def __init__(self, state, compute: Compute, config: ReplicaConfig, group: Group, *, steps: int, global_batch: int,
                 **options):
        """``options``: ``ckpt`` (a :class:`~nvrx_lab.checkpoint.Checkpointer`: the lowest live group saves through
        it), ``before_step`` (called with each new step before it is computed: the trainer's fault injector),
        ``settings`` (values every group must share, beside the gradients' layout: the coordinator refuses another),
        ``sample_ids`` (step -> the ids of its global batch's samples, row by row: the ledger then names the samples
        each rank trained, and checks that none was trained in two committed steps)."""
        if unknown := sorted(set(options) - set(self.OPTIONS)):
            raise TypeError(f"ReplicaLoop: unknown option(s) {unknown}; allowed: {list(self.OPTIONS)}")
        self.state, self.compute, self.rc, self.group = state, compute, config, group
        self.steps, self.global_batch = steps, global_batch
        self.ckpt = options.get("ckpt")  # storage checkpoints (nvrx_lab.checkpoint): the lowest live group saves
        self.before_step: Callable[[int], None] = options.get("before_step") or (lambda step: None)
        self.settings = options.get("settings", {})  # more that every group must share (the layout's)
        self.sample_ids: Callable[[int], list[int]] | None = options.get("sample_ids")
        self.client = ReplicaClient(*config.address, config.replica_id, group.rank, group.world_size,
                                    reconnect_timeout=config.reconnect_timeout, stored=self.ckpt is not None)
        self.client.progress = self.progress = Progress(state.model, state.optimizer, group.device, config.hang_timeout)
        self.plane = Plane(self.client, state, group, config, self.progress)

    @property
    def healing(self) -> bool:
        """This group replaces one of a live job: it takes a live group's state at its first quorum."""
        return self.client.healing

    def _samples(self, work) -> dict:
        if self.sample_ids is None:
            return {}
        ids = self.sample_ids(work.step)
        return {"samples": [ids[i] for r in work.rows for i in range(r.start, r.stop)]}

    def run(self) -> dict:
        """From the first quorum to the last committed step: ``{"steps", "losses", "world_size"}``."""
        if self.group.rank == 0:  # the first join says the gradients' layout: a group of another model is refused
            lay = layout(dict(self.state.model.named_parameters()), self.group.world_size,
                         global_batch=self.global_batch, **self.settings)
            self.client.join(step=0 if self.healing else self.state.step + 1, done=None,
                             layout=lay | {"steps": self.steps})  # the run's last step beside it, not in its digest
        try:
            quorum = self.client.next_quorum()
        except JobFinished as e:
            print(f"[rank {self.group.rank}] replica {self.rc.replica_id}: {e}; exiting", flush=True)
            return {"steps": e.step or 0, "losses": [], "world_size": self.group.world_size}
        try:
            losses = self._steps(quorum)
        except Exception as e:  # this replica fails: the others hear it now, not when its process has exited
            self.client.fail(f"{type(e).__name__}: {e}")
            raise
        self.client.bye()
        return {"steps": self.state.step, "losses": losses, "world_size": self.group.world_size}

    def _steps(self, quorum: Quorum) -> list[float]:
        rc, state, emit, rank = self.rc, self.state, self.group.emit, self.group.rank
        losses, periods, last, group, work = [], [], time.monotonic(), None, None
        while True:
            joiner = rc.replica_id in quorum.joiners  # it heals: what it computed before is not this job's state
            if quorum.committed is not None and work is not None and work.step == quorum.committed and not joiner:
                with self.progress.working():
                    losses.append(work.apply())
                state.step = self.client.position.committed = quorum.committed
                now = time.monotonic()
                periods.append(now - last)
                last = now
                if rank == 0:
                    emit("step", step=state.step, loss=losses[-1], step_time=periods[-1], replica=rc.replica_id,
                         members=len(quorum.members))
                self._after_commit(quorum)
                work = None
            if quorum.resumed or joiner:  # a restarted coordinator: a step computed, not committed, is computed again
                if quorum.resumed:
                    self.plane.resume(quorum, group)
                    group = None
                work = None
                state.optimizer.zero_grad(set_to_none=False)
            if quorum.step > self.steps:
                return losses
            done = None
            group, ready = self.plane.meet(quorum, group, emit)
            # every member computes, ready or not: the table of who holds which rows must be the same everywhere
            with self.progress.working():  # the probe judges a gap here (.progress): hung, or only slow
                work = self._work(work, quorum)
            if ready:
                try:
                    done = self.plane.reduce(work, group, quorum, periods)
                    self.progress.step_finished()
                    emit("ledger", step=work.step, qid=quorum.qid, replica=rc.replica_id,
                         rows=[[r.start, r.stop] for r in work.rows], **self._samples(work))
                except (StepAborted, RuntimeError):  # RuntimeError: the heal broke (a member failed meanwhile)
                    done = None
            done = self._agree(done)
            if rank == 0:
                self.client.join(step=quorum.step + 1 if done is not None else quorum.step, done=done)
            quorum = self.client.next_quorum()

    def _after_commit(self, quorum: Quorum) -> None:
        """A committed step's storage checkpoint (by the lowest live replica) and fingerprint."""
        rc, state = self.rc, self.state
        if self.ckpt is not None and min(set(quorum.members) - set(quorum.joiners)) == rc.replica_id:
            self.ckpt.save(state, state.step)  # due() says whether this step saves
        if rc.fingerprint_every and state.step % rc.fingerprint_every == 0:
            self.group.emit("fingerprint", step=state.step, replica=rc.replica_id,
                            **fingerprint(state.model, state.optimizer))

    def _work(self, work: ReplicaStep | None, quorum: Quorum) -> ReplicaStep:
        """This rank's gradients for the quorum's step: its share of a fresh step, or of the rows the members that
        left held when the step is redone."""
        if work is None or work.step != quorum.step:
            work = ReplicaStep(self.state, self.group, quorum, self.global_batch, self.compute)
            self.before_step(quorum.step)
            work.compute(work.shares.rows(self.rc.replica_id))
        else:
            work.compute(work.shares.redo(quorum)[self.rc.replica_id])
        return work

    def _agree(self, done: int | None) -> int | None:
        """The group finished the step only if every one of its ranks did."""
        if self.group.world_size == 1:
            return done
        flag = torch.tensor([1 if done is not None else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
        return done if flag.item() else None
