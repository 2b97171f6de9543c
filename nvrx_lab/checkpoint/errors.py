"""Checkpoint errors: every one names the step and the path it concerns.

``finalize_async_save`` raises :class:`CheckpointWriteError` (ENOSPC, permission denied, any
exception in the writer) and :class:`CheckpointWriterDied` (the writer process vanished). ``load``
raises :class:`CheckpointCorruptError` (a file fails its checksum or is missing) and
:class:`CheckpointNotFoundError` (missing, empty or foreign directory, unknown step). All derive from
:class:`CheckpointError`, so a trainer that wants to "log and go on" catches one class.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class; ``step`` and ``path`` say which checkpoint and which file or folder."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None):
        super().__init__(message)
        self.step = step
        self.path = path


class CheckpointWriteError(CheckpointError):
    """Writing a shard, the metadata or the commit failed (``errno`` set when the OS said why)."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None,
                 errno: int | None = None):
        super().__init__(message, step=step, path=path)
        self.errno = errno


class CheckpointWriterDied(CheckpointWriteError):
    """The background writer process exited (killed, OOM) before finishing ``step``."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint failed verification: ``path`` is the bad file."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (such) committed checkpoint: the message lists what was found and what is expected."""
