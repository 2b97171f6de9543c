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

A new group is begun in the background (:meth:`ReplicaGroup.begin`) as soon as the quorum is known and waited for only
when its first transfer starts (:meth:`ReplicaGroup.ready`): the members compute their step meanwhile, so a
communicator's setup (2-15 ms for gloo here; an NCCL communicator over EFA on p5, seconds at 16 nodes) is hidden
behind the step instead of added to it. The donor and a joiner need it at once, for the heal.

When the next quorum is the survivors alone (a loss, no joiner) and the backend can shrink (NCCL 2.27+:
``ncclCommShrink``), the survivors' group is the old one shrunk with ``SHRINK_ABORT`` (:meth:`ReplicaGroup.shrink`),
which ends the old one's pending operations and reuses its connections: no new communicator's bootstrap, which on p5
costs a round of the store plus an EFA connection setup per peer. The old group is then kept un-aborted between the
coordinator's word and the shrink. Gloo cannot shrink (``supports_shrinking`` is False): it makes a new group, 2-15 ms
here. A joiner always means a new group.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from nvrx_lab.net import wait_for

SHRINK_ABORT = 0x01
"""``torch.distributed.distributed_c10d.SHRINK_ABORT``: the parent's pending operations are aborted first."""

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
        # torch's stubs make ProcessGroupNCCL/Gloo a Backend without the allreduce/send/recv they have: typed by
        # ProcessGroup's declarations of those
        return pg  # type: ignore[return-value]
    return dist.ProcessGroupGloo(store, index, size, timeout)  # type: ignore[return-value]  # (as above)


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
        self.members, self.rank, self.root = tuple(quorum.members), rank, store
        self.store = dist.PrefixStore(f"rg/{quorum.qid}/{rank}", store)
        self.device, self.timeout_s = torch.device(device), timeout_s
        self.pg: dist.ProcessGroup | None = None
        self._ended: Callable[[], bool] = _nothing_pending  # whether the operation in progress ended
        self._cut = threading.Event()
        self._maker: threading.Thread | None = None  # begin()'s, while the members meet
        self._made: dict = {}
        self._parent: ReplicaGroup | None = None
        self._closed, self._lock = False, threading.Lock()
        self.how, self.setup_s, self.waited_s = "made", 0.0, 0.0
        """How the group was made ("made", "shrunk"), the seconds it took, the seconds the caller waited for it."""

    def begin(self, make: Callable[[], dist.ProcessGroup] | None = None, parent: ReplicaGroup | None = None,
              how: str = "made") -> ReplicaGroup:
        """Start meeting the other members (rank ``k`` of each) in the background: torch's constructor waits for every
        member in the store, NCCL's for a communicator's setup, and the caller computes its step meanwhile;
        :meth:`ready` waits for the end. ``make``: how (default: a new process group); ``parent``: a group it is made
        from, aborted once it is (:meth:`shrink`)."""
        if self.size == 1 or self._maker is not None:
            return self
        make = make or (lambda: new_process_group(self.store, self.index, self.size, self.device,
                                                  timedelta(seconds=self.timeout_s)))
        self.how, self._parent, t0 = how, parent, time.monotonic()

        def run() -> None:
            try:
                pg = make()
            except Exception as e:  # noqa: BLE001 - reported by ready()
                self._made["error"] = e
                return
            finally:
                self.setup_s = time.monotonic() - t0
            with self._lock:
                if not self._closed:
                    self._made["pg"] = pg
                    return
            with contextlib.suppress(RuntimeError):  # left before it was made: abort it here
                pg.abort()

        self._maker = threading.Thread(target=run, daemon=True, name=f"nvrx-replica-group-{self.qid}")
        self._maker.start()
        return self

    def ready(self, aborted: Callable[[], bool]) -> ReplicaGroup:
        """The group :meth:`begin` started, once every member met (``waited_s``: how long the caller waited for it);
        an abort meanwhile, or a member that could not meet, is :class:`StepAborted`."""
        if self.pg is not None or self.size == 1:
            return self
        t0 = time.monotonic()
        try:
            maker = self.begin()._maker
            if maker is None:  # begin() starts one for every group of two or more
                raise RuntimeError(f"quorum {self.qid}: no group is being made")
            self._watch(lambda: not maker.is_alive(), aborted, "the members could not meet")
        finally:
            if self._parent is not None:
                self._parent.close()
                self._parent = None
        self.waited_s = time.monotonic() - t0
        if "error" in self._made:  # a wait of the group's own, bounded by the same timeout, may end first
            late = (f": it took longer than the data plane's timeout ({self.timeout_s:.0f} s, --replica-timeout)"
                    if "timeout" in str(self._made["error"]).lower() else "")
            raise StepAborted(f"quorum {self.qid}: the members could not meet{late} ({self._made['error']})")
        self.pg = self._made.pop("pg")
        return self

    def connect(self, aborted: Callable[[], bool]) -> ReplicaGroup:
        """:meth:`begin` and :meth:`ready` at once."""
        return self.begin().ready(aborted)

    def can_shrink(self, quorum) -> bool:
        """Whether :meth:`shrink` makes ``quorum``'s group: the survivors of this one, nobody new, a backend that
        shrinks (NCCL's; never gloo's)."""
        return (self.pg is not None and not quorum.joiners and set(quorum.members) < set(self.members)
                and len(quorum.members) > 1 and self._shrinks)

    @property
    def _shrinks(self) -> bool:
        """The backend shrinks a group (NCCL's; never gloo's)."""
        return bool(getattr(self.pg, "supports_shrinking", False))

    def shrink(self, quorum, replica: int) -> ReplicaGroup:
        """``quorum``'s group, begun (:meth:`begin`): this one without the members it lost (:meth:`can_shrink`), which
        every survivor makes; this one is aborted once it is ready, or failed."""
        gone, pg = [i for i, m in enumerate(self.members) if m not in quorum.members], self.pg
        if pg is None:
            raise RuntimeError(f"quorum {self.qid}: no group to shrink (see can_shrink)")
        new = ReplicaGroup(self.root, quorum, replica, self.rank, self.device, self.timeout_s)
        # torch's stubs lack the backends' shrink (ProcessGroupNCCL.shrink, torch 2.10+)
        return new.begin(lambda: pg.shrink(gone, SHRINK_ABORT, None), parent=self, how="shrunk")  # type: ignore[attr-defined]

    def _live(self) -> dist.ProcessGroup:
        """The process group, between :meth:`ready` and :meth:`close` (closed meanwhile: :class:`StepAborted`)."""
        if self.pg is None:
            raise StepAborted(f"quorum {self.qid}: the group was closed")
        return self.pg

    def cut(self) -> None:
        """From any thread: end this group's transfers now (the quorum was aborted)."""
        self._cut.set()

    def close(self) -> None:
        """Leave the group for good (a new quorum has its own): abort it, which waits for no other member, and keep it
        until its pending operations end (they fail once the member they wait on is gone)."""
        _abandoned[:] = [(pg, ended) for pg, ended in _abandoned if not ended()]
        with self._lock:
            self._closed = True  # a group still being made is aborted by its maker; one made and not taken, here
            if (unused := self._made.pop("pg", None)) is not None:
                with contextlib.suppress(RuntimeError):
                    unused.abort()
        if self._parent is not None:
            self._parent.close()
            self._parent = None
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
        self.ready(aborted)
        works = [self._live().allreduce([t]) for t in tensors]
        self._wait(works, aborted, "the sum", patience, on_stuck)

    def send(self, tensors: list[torch.Tensor], dst: int, aborted: Callable[[], bool],
             on_done: Callable[[], None] = lambda: None) -> None:
        """Send ``tensors`` to member index ``dst``, one after another (``on_done`` after each)."""
        self.ready(aborted)
        for t in tensors:
            self._wait([self._live().send([t], dst, 0)], aborted, f"a send to member {dst}", point_to_point=True)
            on_done()

    def recv(self, tensors: list[torch.Tensor], src: int, aborted: Callable[[], bool],
             on_done: Callable[[], None] = lambda: None) -> None:
        """Receive into ``tensors`` from member index ``src``, one after another (``on_done`` after each)."""
        self.ready(aborted)
        for t in tensors:
            self._wait([self._live().recv([t], src, 0)], aborted, f"a receive from member {src}", point_to_point=True)
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
        t0, told = time.monotonic(), [False]

        def finished() -> bool:
            if done():
                return True
            if aborted() or self._cut.is_set():
                self._abort()
                raise StepAborted(f"quorum {self.qid}: {what} was aborted by the coordinator")
            if not told[0] and time.monotonic() - t0 > patience:
                on_stuck()
                told[0] = True
            return False

        try:
            wait_for(finished, self.timeout_s, what, interval=TICK_S)
        except TimeoutError:
            self._abort()
            raise StepAborted(f"quorum {self.qid}: {what} took longer than the data plane's timeout "
                              f"({self.timeout_s:.0f} s, --replica-timeout)") from None

    def _abort(self) -> None:
        """End the wait now; the group itself is aborted now, or by the survivors' :meth:`shrink` (which aborts its
        pending operations first) or their next :meth:`close` on a backend that shrinks."""
        self._cut.set()
        if not self._shrinks:
            self.close()
