"""What the checkpoint layer asks of its callers, and what a trainer may ask of it: typed, not probed.

* :class:`Stateful` — what can be checkpointed to storage: DCP's ``state_dict()``/``load_state_dict()``;
* :class:`LiveStateful` — what local snapshots need too: this rank's live tensors (``local_state_dict()``, the
  same world and model) and how to take them back after they were filled in place;
* :class:`IOHooks` — what the caller hears of a save or a load: a context around each piece of I/O (an
  in-process restart must not cut it; the launcher's heartbeat section), the moment inside it, and a save
  handed over. The trainer's :class:`~nvrx_lab.train.hooks.Hooks` is one; :data:`NO_HOOKS` hears nothing;
* :class:`Checkpointer` — what a training loop needs of checkpointing: ``restore`` the newest state from the
  nearest copy, ``save`` at every step (the checkpointer decides whether this step saves, to which tier, sync or
  async), ``finish`` at the end, and the lifecycle across in-process restarts. :class:`~.manager.CheckpointManager`
  implements it over :class:`~.checkpointer.AsyncCheckpointer` (storage) and :class:`~.local.LocalCheckpointer`.
"""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

from .loading import Restored


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state_dict: dict) -> None: ...


@runtime_checkable
class LiveStateful(Stateful, Protocol):
    def local_state_dict(self) -> dict:
        """This rank's live tensors (parameters, optimizer state) and plain values, by name; filled in place."""

    def load_local_state_dict(self, state_dict: dict) -> None:
        """Take back what :meth:`local_state_dict` returned, after its tensors were filled in place."""


class IOHooks(Protocol):
    def section(self, name: str) -> contextlib.AbstractContextManager:
        """Around one piece of checkpoint I/O: ``checkpoint_load``, ``checkpoint``, ``checkpoint_local``,
        ``checkpoint_commit``, ``checkpoint_finalize``."""

    def during(self, phase: str, step: int) -> None:
        """Inside that I/O: ``load`` once read, ``save`` once handed over."""

    def after_save(self) -> None:
        """A storage save was handed over."""

    def progress(self) -> None:
        """A legitimate wait goes on (the writer starting, a blocking commit)."""


class _NoHooks:
    def section(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def during(self, phase: str, step: int) -> None: ...
    def after_save(self) -> None: ...
    def progress(self) -> None: ...


NO_HOOKS: IOHooks = _NoHooks()


class Checkpointer(Protocol):
    def restore(self, state: LiveStateful, io: IOHooks = NO_HOOKS) -> Restored | None:
        """Collective: load the newest step from the nearest copy that has it into ``state``; None: nothing to load."""

    def save(self, state: LiveStateful, step: int, io: IOHooks = NO_HOOKS, force: bool = False) -> bool:
        """Called after every step: save ``step`` if one of the intervals (or ``force``) says so, and commit what
        finished; True if a save was made. A failed save is reported, never raised: the previous one stays."""

    def finish(self, io: IOHooks = NO_HOOKS) -> None:
        """The last step is done: wait until every save made is committed (or has failed)."""

    def rebind(self, group) -> None:
        """An in-process restart made a new process group: coordinate over it from now on."""

    def close(self) -> None:
        """The run ended cleanly: stop the background work and free its memory."""

    def abandon(self) -> None:
        """The run failed: stop at once, keeping every committed copy (a replacement process restores it)."""


__all__ = ["Checkpointer", "IOHooks", "LiveStateful", "NO_HOOKS", "Restored", "Stateful"]
