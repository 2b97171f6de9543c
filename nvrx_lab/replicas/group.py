"""The cross-replica group of one quorum, on torch's own process groups: gloo here, NCCL on a GPU.

Rank ``k`` of every member of quorum ``q`` sums gradients with rank ``k`` of the others: HSDP's replicate dimension.
The group is torch's ``ProcessGroupGloo`` (host tensors) or ``ProcessGroupNCCL`` (device tensors, non-blocking init,
so an abort can interrupt its setup too), made over the coordinator's ``TCPStore`` under a prefix of its own
(``rg/<qid>/<k>``). It is made when the members change (a new ``qid``), never per step: 2-15 ms here for a gloo
group; on p5 an NCCL communicator over EFA, once per fault.

Nothing a failure does can wedge a rank, because no rank blocks inside torch: every operation is issued
asynchronously and watched from the caller's thread (:meth:`ReplicaGroup._watch`) until it is done, the coordinator
aborts the quorum (a member failed: :meth:`cut` from the client's reader thread), or the data plane's timeout passes.

* a member whose process dies closes its connections: gloo's pending operation fails at once on every peer;
* a member that hangs: the coordinator says so; the wait is given up at once and the group aborted (NCCL:
  ``ncclCommAbort`` frees its kernels; gloo: its worker thread fails as soon as the hung member, evicted, exits) and
  never used again: the survivors meet in the next quorum's group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from nvrx_lab.net import wait_for

TICK_S = 0.002
"""How often a watched operation looks at its completion, the coordinator's word and its clocks."""
_abandoned: list[tuple[dist.ProcessGroup, Callable[[], bool]]] = []
"""Aborted groups with operations still pending (and what says they ended), kept alive until those end: gloo's
destructor joins its worker threads, and a thread blocked on a hung member would hold the caller (60 s here) until
that member exited."""


def _nothing_pending() -> bool:
    return True


class StepAborted(RuntimeError):
    """The step's reduction was aborted: a member of the quorum failed (or the data plane's timeout passed)."""


def new_process_group(store: dist.Store, index: int, size: int, device: torch.device,
                      timeout: timedelta) -> dist.ProcessGroup:
    """Torch's process group for ``device``: NCCL with non-blocking init for CUDA tensors, gloo for host ones."""
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.config.blocking = 0  # non-blocking communicator init: an abort ends a setup that waits for a lost member
        pg = dist.ProcessGroupNCCL(store, index, size, opts)
        pg.eager_connect_single_device(device)
        return pg
    return dist.ProcessGroupGloo(store, index, size, timeout)


def _wait_all(works: list, errors: list) -> None:
    try:
        for w in works:
            w.wait()
    except RuntimeError as e:
        errors.append(e)


def open_store(host: str, port: int, timeout: float = 60.0) -> dist.TCPStore:
    """The coordinator's store, once per rank: where every quorum's process group meets."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


class ReplicaGroup:
    def __init__(self, store: dist.Store, quorum, replica: int, rank: int, device: torch.device,
                 timeout_s: float = 300.0):
        self.qid, self.index, self.size = quorum.qid, quorum.index(replica), len(quorum.members)
        self.store = dist.PrefixStore(f"rg/{quorum.qid}/{rank}", store)
        self.device, self.timeout_s = torch.device(device), timeout_s
        self.pg: dist.ProcessGroup | None = None
        self._ended: Callable[[], bool] = _nothing_pending  # whether the operation in progress ended
        self._cut = threading.Event()

    def connect(self, aborted: Callable[[], bool]) -> ReplicaGroup:
        """Meet the other members (rank ``k`` of each); an abort meanwhile ends the wait (:class:`StepAborted`)."""
        if self.size == 1:
            return self
        made: dict = {}

        def make() -> None:  # torch's constructor waits for every member in the store: off the watched thread
            try:
                made["pg"] = new_process_group(self.store, self.index, self.size, self.device,
                                               timedelta(seconds=self.timeout_s))
            except Exception as e:  # noqa: BLE001 - reported to the watcher below
                made["error"] = e

        maker = threading.Thread(target=make, daemon=True, name=f"nvrx-replica-group-{self.qid}")
        maker.start()
        self._watch(lambda: not maker.is_alive(), aborted, "the members could not meet")
        if "error" in made:
            raise StepAborted(f"quorum {self.qid}: the members could not meet ({made['error']})")
        self.pg = made["pg"]
        return self

    def cut(self) -> None:
        """From any thread: end this group's transfers now (the quorum was aborted)."""
        self._cut.set()

    def close(self) -> None:
        """Leave the group for good (a new quorum has its own): abort it, which waits for no other member, and keep it
        until its pending operations end (they fail once the member they wait on is gone)."""
        _abandoned[:] = [(pg, ended) for pg, ended in _abandoned if not ended()]
        if self.pg is not None:
            pg, self.pg = self.pg, None
            try:
                pg.abort()
            except RuntimeError:
                pass
            if not self._ended():
                _abandoned.append((pg, self._ended))
        self._ended = _nothing_pending

    def all_reduce(self, tensors: list[torch.Tensor], aborted: Callable[[], bool], patience: float,
                   on_stuck: Callable[[], None]) -> None:
        """Sum ``tensors`` over the members, in place (all issued at once, then watched): :class:`StepAborted` if the
        quorum is aborted meanwhile or a member's connection closes; ``on_stuck`` once past ``patience``."""
        if self.size == 1:
            return
        works = [self.pg.allreduce([t]) for t in tensors]
        self._wait(works, aborted, "the sum", patience, on_stuck)

    def send(self, tensors: list[torch.Tensor], dst: int, aborted: Callable[[], bool],
             on_done: Callable[[], None] = lambda: None) -> None:
        """Send ``tensors`` to member index ``dst``, one after another (``on_done`` after each)."""
        for t in tensors:
            self._wait([self.pg.send([t], dst, 0)], aborted, f"a send to member {dst}", point_to_point=True)
            on_done()

    def recv(self, tensors: list[torch.Tensor], src: int, aborted: Callable[[], bool],
             on_done: Callable[[], None] = lambda: None) -> None:
        """Receive into ``tensors`` from member index ``src``, one after another (``on_done`` after each)."""
        for t in tensors:
            self._wait([self.pg.recv([t], src, 0)], aborted, f"a receive from member {src}", point_to_point=True)
            on_done()

    def _wait(self, works: list, aborted: Callable[[], bool], what: str, patience: float = float("inf"),
              on_stuck: Callable[[], None] = lambda: None, point_to_point: bool = False) -> None:
        """Watch ``works`` to their end. Gloo's point-to-point works say they are complete only once waited for, so
        those are waited for by a thread of their own, which the watch (and :meth:`close`) looks at instead (left
        behind on an abort, it ends when the operation fails)."""
        errors: list = []
        if point_to_point:
            waiter = threading.Thread(target=_wait_all, args=(works, errors), daemon=True, name="nvrx-replica-p2p")
            waiter.start()
            done = lambda: not waiter.is_alive()  # noqa: E731
        else:
            done = lambda: all(w.is_completed() for w in works)  # noqa: E731
        self._ended = done
        self._watch(done, aborted, what, patience, on_stuck)
        try:
            if errors:
                raise errors[0]
            for w in works if not point_to_point else ():  # (waited for once: a second wait never returns)
                w.wait()
        except RuntimeError as e:  # a member's connection closed: it died
            self._abort()
            raise StepAborted(f"quorum {self.qid}: {what} failed ({str(e).splitlines()[0][:200]})") from None

    def _watch(self, done: Callable[[], bool], aborted: Callable[[], bool], what: str, patience: float = float("inf"),
               on_stuck: Callable[[], None] = lambda: None) -> None:
        """Until ``done()``; :class:`StepAborted` on the coordinator's word or past the data plane's timeout."""
        t0, told = time.monotonic(), []

        def finished() -> bool:
            if done():
                return True
            if aborted() or self._cut.is_set():
                self._abort()
                raise StepAborted(f"quorum {self.qid}: {what} was aborted by the coordinator")
            if not told and time.monotonic() - t0 > patience:
                told.append(on_stuck())
            return False

        try:
            wait_for(finished, self.timeout_s, what, interval=TICK_S)
        except TimeoutError:
            self._abort()
            raise StepAborted(f"quorum {self.qid}: {what} took longer than the data plane's timeout "
                              f"({self.timeout_s:.0f} s, --replica-timeout)") from None

    def _abort(self) -> None:
        self._cut.set()
        self.close()
