"""Two tiers as one checkpointer: local snapshots every few steps, storage checkpoints as the fallback.

:class:`Tiered` is an :class:`~.checkpointer.AsyncCheckpointer` (every storage call goes to it unchanged)
with a :class:`~.local.LocalCheckpointer` beside it: :meth:`save_local` takes a snapshot, and
:meth:`restore` picks the nearest copy of the newest step — this process's memory, the node's shared
memory, the peer's replica, else storage.
"""

from __future__ import annotations

from .checkpointer import AsyncCheckpointer
from .loading import Restored
from .local import LocalCheckpointer


class Tiered:
    """An AsyncCheckpointer (``storage``) plus local snapshots (``local``); see the module docs."""

    def __init__(self, storage: AsyncCheckpointer, local: LocalCheckpointer):
        self.storage, self.local = storage, local

    def __getattr__(self, name):  # latest_step, load, save, async_save, prepare, start, writer_pid, ...
        return getattr(self.storage, name)

    def save_local(self, state_dict: dict, step: int) -> float:
        return self.local.save(state_dict, step)

    def restore(self, state) -> Restored | None:
        """Collective: the newest step from the nearest copy (local when it is at least as new as storage)."""
        storage_step = self.storage.latest_step()  # verified once: the local copy must be at least as new
        got = self.local.restore(state, storage_step)
        if got is not None or storage_step is None:
            return got
        restored = self.storage.restore(state, step=storage_step)
        if self.local.reached:
            restored.rollback_steps = max(0, self.local.reached - restored.step)
        return restored

    def rebind(self, process_group=None) -> None:
        self.storage.rebind(process_group)
        self.local.bind(self.storage.group, self.storage.rank, self.storage.world)

    def close(self) -> None:
        try:
            self.storage.close()
        finally:
            self.local.close()

    def abandon(self) -> int | None:
        """A failed process: the node keeps its local copies for the replacement (or the janitor)."""
        try:
            return self.storage.abandon()
        finally:
            self.local.close(keep=True)
