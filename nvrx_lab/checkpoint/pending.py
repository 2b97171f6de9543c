"""Rank 0's saves in flight: each waits on the completion board until every rank finished, then commits.

:class:`PendingSaves` is the coordinator's half of an async save. A save joins it when rank 0 hands its own
shards to the writer (:meth:`add`); :meth:`commit` commits the oldest ones every rank posted as done (one
store operation a pending save, :func:`.commit.commit_ready`), waiting up to ``wait_s`` for each.
After an in-process restart the saves of the aborted attempt stay bound to the old group's board, whose
store outlives the group: :meth:`settle` commits what the old world finishes in time and drops the rest.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from . import commit as cm


class PendingSaves:
    def __init__(self, root: Path, retention, report: Callable, emit: Callable, failed: Callable[[], set]):
        self.root, self.retention, self.report, self.emit, self.failed = root, retention, report, emit, failed
        self.board, self.world = None, 1
        self.saves: list[dict] = []
        """Oldest first: step, tmp, metadata, t0 (monotonic, at the save), save_id."""
        self.durable_s = 1.0
        """How long the newest commit took from its save (what :meth:`settle` waits for, twice over)."""

    def __bool__(self) -> bool:
        return bool(self.saves)

    def bind(self, board, world: int) -> None:
        """The board and world of the current group (saves added from now on belong to them)."""
        self.board, self.world = board, world

    def add(self, step: int, tmp: Path, metadata, t0: float, save_id: str) -> None:
        self.saves.append({"step": step, "tmp": tmp, "metadata": metadata, "t0": t0, "save_id": save_id})

    def commit(self, wait_s: float = 0.0) -> list[int]:
        """Commit what every rank finished, waiting ``wait_s`` for each pending save (0: not at all)."""
        started = {p["step"]: p["t0"] for p in self.saves}
        committed = cm.commit_ready(self.saves, self.root, self.board, self.world, self.retention, wait_s,
                                    self.report, self.emit, failed_steps=self.failed())
        if committed:
            self.durable_s = time.monotonic() - started[committed[-1]]
        return committed

    def settle(self, wait_s: float) -> None:
        """The group these saves belong to is gone: commit what its ranks finish within ``wait_s`` (the store
        may be gone too: then nothing), drop the rest."""
        try:
            self.commit(wait_s)
        except Exception:  # noqa: BLE001 - the old group's store went with it: those saves are lost
            pass
        self.saves.clear()

    def drop(self) -> None:
        """Forget every pending save and remove its temporary folder (no writer writes into it any more)."""
        for p in self.saves:
            shutil.rmtree(p["tmp"], ignore_errors=True)
        self.saves.clear()


def stopped_line(rank: int, step: int, committed: list[int]) -> str:
    """What became of the save of ``step`` when the run stopped: only rank 0, which commits, knows."""
    if rank != 0:
        return (f"this rank's write of step {step} was stopped; rank 0 commits step {step} only if every rank had "
                "finished it (its line says which)")
    if step in committed:
        return f"the save of step {step} committed as the run stopped"
    return (f"the save of step {step} was abandoned (not every rank had finished it): not committed; the committed "
            "checkpoints are intact")

