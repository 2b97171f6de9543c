"""One rank's side of the cross-replica data plane: the quorum's process group, the heal over it, the step's sum,
and the store where the groups meet (a restarted coordinator hosts a new one)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .client import ReplicaClient
from .group import ReplicaGroup, StepAborted, open_store
from .heal import HEAL_BPS_FLOOR, recv_state, send_state, state_bytes
from .progress import Progress
from .protocol import Quorum

if TYPE_CHECKING:
    from nvrx_lab.train.state import TrainState

    from .config import ReplicaConfig
    from .loop import Group
    from .step import ReplicaStep

COLD_PATIENCE_S = 5.0
"""The least a step with a replacement in it, or a redo, waits before the coordinator hears of it (on a loaded box a
re-formed group's first reduction took more than twice a warm step, and a healthy member was dropped as hung)."""


class Plane:
    """This rank's side of the data plane: the quorum's process group, the heal over it, the step's sum."""

    def __init__(self, client: ReplicaClient, state: TrainState, group: Group, rc: ReplicaConfig, progress: Progress):
        self.client, self.state, self.me, self.rc, self.progress = client, state, group, rc, progress
        self.store = open_store(client.address[0], client.store_port)  # where the quorums' groups meet
        self.state_bytes = state_bytes(state.local_state_dict())

    def resume(self, quorum: Quorum, group: ReplicaGroup | None) -> None:
        """The first quorum of a restarted coordinator (:mod:`.admission`): this rank must hold the step it goes on
        from (a joiner heals instead); the groups meet in the new coordinator's store; one line says so."""
        held, replica = self.state.step, self.client.replica
        if replica not in quorum.joiners and held != (quorum.committed or 0):
            raise RuntimeError(f"replica {replica} holds step {held}, and the restarted coordinator goes on from step "
                               f"{quorum.committed}: a replacement will heal")
        if group is not None:
            group.close()
        self.store = open_store(self.client.address[0], self.client.store_port)
        print(f"[nvrx_lab.replicas] replica {replica} rank {self.me.rank}: the restarted coordinator goes on "
              f"at step {quorum.step} from committed step {quorum.committed} with replica groups "
              f"{list(quorum.members)}{f' (healing {list(quorum.joiners)})' if quorum.joiners else ''}",
              file=sys.stderr, flush=True)

    def meet(self, quorum: Quorum, group: ReplicaGroup | None,
             emit: Callable[..., None]) -> tuple[ReplicaGroup | None, bool]:
        """This quorum's group (and its heal when this replica gives or takes state); ready is False when a member
        failed while the group met: the step is computed all the same and reduced at the next quorum."""
        replica = self.client.replica
        try:
            if group is None or group.qid != quorum.qid:
                group = self._group(quorum, group)  # begun: it is made while this rank computes
            if replica == quorum.donor or replica in quorum.joiners:
                self._ready(group, quorum)
                with self.progress.working():  # each chunk is a unit: a large heal is slow, not hung
                    self._heal(group, quorum, emit)
            return group, True
        except (StepAborted, RuntimeError) as e:
            if replica in quorum.joiners:  # without a donor's state this process cannot train: a replacement will
                raise RuntimeError(f"replica {replica} could not heal from replica {quorum.donor}: {e}") from None
            return group, False

    def _group(self, quorum: Quorum, old: ReplicaGroup | None) -> ReplicaGroup:
        """The process group of this quorum, begun (:meth:`ReplicaGroup.begin`): the last one shrunk where the backend
        can (:meth:`ReplicaGroup.shrink`), else a new one (the last one aborted)."""
        if old is not None and old.can_shrink(quorum):
            group = old.shrink(quorum, self.client.replica)
        else:
            if old is not None:
                old.close()
            group = ReplicaGroup(self.store, quorum, self.client.replica, self.me.rank, self.me.device,
                                 self.rc.timeout).begin()
        self.client.on_abort = lambda qid: group.cut() if qid == group.qid else None
        return group

    def _ready(self, group: ReplicaGroup, quorum: Quorum) -> None:
        """Wait for the quorum's group (an abort meanwhile ends the wait); once, the event says how it was made, in how
        long, and how long of that this rank waited (the rest was hidden behind its step)."""
        if group.pg is None and group.size > 1:
            group.ready(lambda: self.client.aborted(quorum.qid))
            self.me.emit("replica_group", step=quorum.step, qid=quorum.qid, members=list(quorum.members),
                         how=group.how, setup_s=group.setup_s, waited_s=group.waited_s)

    def _heal(self, group: ReplicaGroup, quorum: Quorum, emit: Callable[..., None]) -> None:
        t0, aborted, state = time.monotonic(), (lambda: self.client.aborted(quorum.qid)), self.state
        if self.client.replica == quorum.donor:
            sent = send_state(group, [quorum.index(j) for j in quorum.joiners], state.local_state_dict(), aborted,
                              self.progress.unit)
            emit("heal_sent", step=quorum.step, to=list(quorum.joiners), bytes=sent,
                        seconds=time.monotonic() - t0)
        else:
            state.load_local_state_dict(recv_state(group, quorum.index(quorum.donor), state.local_state_dict(),
                                                   aborted, self.progress.unit))
            state.data.position = state.step = self.client.position.committed = quorum.step - 1
            emit("healed", step=quorum.step, donor=quorum.donor, seconds=time.monotonic() - t0)

    def reduce(self, work: ReplicaStep, group: ReplicaGroup, quorum: Quorum, periods: list[float]) -> int:
        """Sum the step's gradients over the members; the step it finished (:class:`StepAborted` if it did not)."""
        self._ready(group, quorum)
        buckets = work.buckets()
        wait = self.rc.patience or (max(0.05, 2 * statistics.median(periods[-20:])) if periods else 5.0)
        if quorum.joiners or quorum.committed is None:  # a replacement's first step, or a redo on a group just
            wait = max(wait, COLD_PATIENCE_S)            # re-formed, runs cold: not a hang at twice a warm step
        if quorum.joiners:  # ...and the donor and its joiners move the state first
            wait += self.state_bytes * len(quorum.joiners) / HEAL_BPS_FLOOR
        # the loss in its own float64 tensor: float32 beside the gradients moved the curve 1.3e-6 off (1 run of 6)
        loss = torch.tensor([work.loss_sum], dtype=torch.float64, device=buckets[0].device)
        group.all_reduce([*buckets, loss], lambda: self.client.aborted(quorum.qid), wait,
                         lambda: self.client.stuck(quorum.step, quorum.qid))
        work.reduced = buckets, loss
        return quorum.step
