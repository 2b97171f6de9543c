"""Abort policies: unblock the main thread's communication when an attempt must end
=================================================================================

Called by the monitor thread, *before* it signals the main thread, with the attempt's
:class:`~.state.State`. Each is a small callable ``abort(state) -> state``; combine them with
:class:`~.compose.Compose`. The main thread then destroys the process group itself once it is
out of the collective (see :mod:`.wrap`), so an abort never races a half-finished
``destroy_process_group``.
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist

from nvrx_lab.flight_recorder import take_dump

from .interrupt import SocketTracker
from .state import State


class Abort(abc.ABC):
    """Base class: ``__call__(state) -> state``; must return quickly and never block."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State: ...


class AbortTorchDistributed(Abort):
    """Makes every pending collective of this attempt fail now, NCCL first.

    1. NCCL (when CUDA is available): ``ProcessGroupNCCL.abort()`` on every group's CUDA backend
       (``ncclCommAbort``: kernels stop, the communicator and its proxy go away cleanly).
    2. gloo (and the store client while the group initialises): ``shutdown(SHUT_RDWR)`` of the
       sockets the attempt's gloo part opened (:class:`~.interrupt.SocketTracker`); peers blocked
       with us fail at once too. NCCL's sockets are not among them, and the main thread, freed by
       a gloo error, never races an NCCL abort still in progress into ``destroy_process_group``.
    """

    def __init__(self, sockets: SocketTracker | None = None):
        self.sockets = sockets
        """Set by the Wrapper to the attempt's tracker; ``None`` skips the gloo part."""
        self.dump_to: str | None = None
        """Set by the Wrapper: where this rank's flight recorder goes before the abort (``$TORCH_FR_DUMP_TEMP_FILE``
        and the rank, torch's own naming); ``None``: no dump."""
        self.dumped: dict | None = None
        """The last dump's outcome (:func:`~nvrx_lab.flight_recorder.take_dump`), for the restart record."""

    def __call__(self, state: State) -> State:
        if self.dump_to is not None:  # first: which collective never completed, before the abort clears the way
            try:
                self.dumped = {**take_dump(self.dump_to), "path": self.dump_to}
            except Exception as exc:  # noqa: BLE001 - a dump that failed must not stop the abort
                self.dumped = {"ok": False, "why": f"{type(exc).__name__}: {exc}", "path": self.dump_to}
        try:
            abort_nccl()
        finally:
            if self.sockets is not None:
                self.sockets.cut()
        return state


def prepare_dump() -> None:
    """Import now what the first dump imports: torch's flight recorder symbolizes its entries' stacks with
    ``torch._dynamo``, loaded on first use (~10 s on a loaded 2-core box). Inside the first abort that import came
    before the cut: the rank, and every peer waiting in its collective, stood still until a hard timeout killed one."""
    import torch._dynamo  # noqa: F401


def abort_nccl() -> int:
    """``abort()`` the NCCL backend of every live process group; returns how many were aborted
    (0 without CUDA or without a group)."""
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return 0
    n = 0
    for pg in list(dist.distributed_c10d._world.pg_map.keys()):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except Exception:  # no CUDA backend on this group
            continue
        if type(backend).__name__ == "ProcessGroupNCCL":  # torch's backend object, by its class
            backend.abort()
            n += 1
    return n


class AbortCallback(Abort):
    """Wraps any ``fn(state)`` (e.g. cancel an async checkpoint writer) as an abort policy."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, state: State) -> State:
        self.fn(state)
        return state
