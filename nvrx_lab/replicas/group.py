"""The cross-replica process group of one quorum: what a failure cannot wedge.

Rank ``k`` of every member of quorum ``q`` meets rank ``k`` of the others in a gloo group of its own
(``ProcessGroupGloo`` on the coordinator's store, prefix ``q<q>/k<k>``): HSDP's replica dimension. Its sockets
are remembered (:mod:`nvrx_lab.sockets`), and :meth:`ReplicaGroup.cut` shuts them: a reduction waiting on a
member that died (its peers see the closed socket themselves) or hangs (the coordinator says so) fails at
once on every rank, and the members meet again in the next quorum's group.

:meth:`ReplicaGroup.all_reduce` runs the reduction asynchronously and watches it: done; aborted by the
coordinator (cut, :class:`StepAborted`); or taking longer than ``patience`` (told to the coordinator once, which
looks for the member everybody waits for).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from nvrx_lab.net import wait_for
from nvrx_lab.sockets import shutdown_connected, socket_fds


class StepAborted(RuntimeError):
    """The step's reduction was aborted: a member of the quorum failed."""


class ReplicaGroup:
    def __init__(self, qid: int, index: int, size: int):
        self.qid, self.index, self.size = qid, index, size
        self._lock = threading.Lock()
        self._cut = False
        self._before = socket_fds()
        self._fds: set[int] | None = None
        self.pg = None

    def connect(self, host: str, store_port: int, local_rank: int, timeout: float = 60.0) -> ReplicaGroup:
        """Meet the other members (rank ``local_rank`` of each) on the coordinator's store; a :meth:`cut` meanwhile
        ends the wait (:class:`StepAborted`)."""
        try:
            self._store = dist.TCPStore(host, store_port, is_master=False, timeout=timedelta(seconds=timeout))
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"q{self.qid}/k{local_rank}", self._store), self.index,
                                            self.size, timedelta(seconds=timeout))
            if self.size > 1:  # gloo connects its full mesh lazily on some paths: one barrier, then every socket is there
                self.pg.barrier().wait()
        except RuntimeError as e:
            self.cut()
            raise StepAborted(f"quorum {self.qid}: the members could not meet ({str(e).splitlines()[0][:160]})") from None
        with self._lock:
            self._fds = socket_fds() - self._before
            if self._cut:  # cut while connecting: the sockets it made since are of no use either
                shutdown_connected(self._fds)
                raise StepAborted(f"quorum {self.qid} aborted")
        return self

    def cut(self) -> None:
        """From any thread: end every collective of this group now (it is of no use any more)."""
        with self._lock:
            if not self._cut:
                self._cut = True
                shutdown_connected(self._fds if self._fds is not None else socket_fds() - self._before)

    def all_reduce(self, tensor: torch.Tensor, aborted: Callable[[], bool], patience: float,
                   on_stuck: Callable[[], None]) -> None:
        """Sum ``tensor`` over the members, in place; :class:`StepAborted` if the quorum is aborted meanwhile."""
        if self.size == 1:
            return
        work = self.pg.allreduce([tensor])
        t0, told = time.monotonic(), False

        def settled() -> bool:
            nonlocal told
            if work.is_completed() or aborted() or self._cut:
                return True
            if not told and time.monotonic() - t0 > patience:
                told = True
                on_stuck()
            return False

        wait_for(settled, float("inf"), f"the reduction of quorum {self.qid}", interval=0.0005)
        if aborted() or self._cut:
            self.cut()
            raise StepAborted(f"quorum {self.qid} aborted")
        try:
            work.wait()
        except RuntimeError as e:  # a member died: its socket closed under us
            self.cut()
            raise StepAborted(f"quorum {self.qid}: {str(e).splitlines()[0][:160]}") from None

    def send(self, tensor: torch.Tensor, to: int):
        return self.pg.send([tensor], to, 0)

    def recv(self, tensor: torch.Tensor, src: int):
        return self.pg.recv([tensor], src, 0)
