"""The cross-replica group of one quorum: what a failure cannot wedge.

Rank ``k`` of every member of quorum ``q`` sums gradients with rank ``k`` of the others: HSDP's replica dimension.
The data plane is our own ring of plain TCP connections (:mod:`.ring`): a new quorum costs each rank one connect
to the next member (gloo's full mesh took 10-30 ms a quorum here, more than the step it was formed for), and
:meth:`ReplicaGroup.cut` shuts the ring's sockets, so a sum waiting on a member that died (its peers see the closed
socket themselves) or hangs (the coordinator says so) fails at once on every rank, and the members meet again in
the next quorum's ring.

:meth:`ReplicaGroup.all_reduce` watches the sum while it runs: done; aborted by the coordinator (cut,
:class:`StepAborted`); or taking longer than ``patience`` (told to the coordinator once, which looks for the member
everybody waits for). On a GPU the buffer is copied to host memory first (the caller's ``flat``); the ring moves
host memory, as gloo did.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .protocol import Quorum
from .ring import Endpoint, Ring, RingBroken


class StepAborted(RuntimeError):
    """The step's reduction was aborted: a member of the quorum failed."""


class ReplicaGroup:
    def __init__(self, endpoint: Endpoint, quorum: Quorum, replica: int, rank: int):
        self.qid, self.index, self.size = quorum.qid, quorum.index(replica), len(quorum.members)
        self.ring = Ring(endpoint, quorum.qid, quorum.members, self.index, rank)

    def connect(self, timeout: float = 60.0) -> ReplicaGroup:
        """Meet the other members (rank ``rank`` of each); a :meth:`cut` meanwhile ends the wait (:class:`StepAborted`)."""
        try:
            self.ring.connect(timeout)
        except RingBroken as e:
            self.cut()
            raise StepAborted(f"quorum {self.qid}: the members could not meet ({e})") from None
        return self

    def cut(self) -> None:
        """From any thread: end every transfer of this group now (it is of no use any more)."""
        self.ring.cut()

    def close(self) -> None:
        self.ring.close()

    def all_reduce(self, tensor: torch.Tensor, aborted: Callable[[], bool], patience: float,
                   on_stuck: Callable[[], None]) -> None:
        """Sum ``tensor`` (contiguous, in host memory) over the members, in place; :class:`StepAborted` if the quorum
        is aborted meanwhile or a member's connection closes."""
        if self.size == 1:
            return
        t0, told = time.monotonic(), False

        def tick() -> None:  # between transfers, and every few milliseconds while nothing moves
            nonlocal told
            if aborted():
                raise RingBroken("aborted by the coordinator")
            if not told and time.monotonic() - t0 > patience:
                told = True
                on_stuck()

        try:
            self.ring.all_reduce(tensor, tick)
        except RingBroken as e:
            self.cut()
            raise StepAborted(f"quorum {self.qid}: {e}") from None
