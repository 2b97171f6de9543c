"""Completion board: how rank 0 learns that every rank's shards are durable, without touching the disk.

Each rank posts one entry per save when its writer is done (or has failed); the coordinator counts
the posts with one store operation per finalize and reads them all with one more once every rank
has posted. No marker files, no directory polling: the metadata operations of a save are the shard
files themselves plus a constant at the coordinator (:mod:`.commit`).

On a :class:`torch.distributed.Store` (the process group's own: the torchrun agent's store, or an
in-process restart attempt's prefix store), under keys unique to the save's ``save_id``::

    <prefix>/<save_id>/posts   every rank's entry, one JSON line each (``append``: atomic per call)
    <prefix>/<save_id>/n       posts + failures · 2**32 (``add``: a poster adds 1, or 1 + 2**32)

Store operations: each rank's :meth:`StoreBoard.post` is 2 (``append``, then ``add``); rank 0's
:meth:`StoreBoard.tally` is 1 per finalize while a save is pending (0 when none is); once a save is
complete, :meth:`StoreBoard.collect` is 1 ``get`` and :meth:`StoreBoard.forget` 2 ``delete_key``.
A rank posts from its trainer's writer-reader thread the moment its writer answers
(:mod:`.writer`), so rank 0 never waits for another rank's training loop to call anything.

The entry is appended before the counter moves, on the same connection, so a counted entry is
always readable. A failure sets the high half of the counter, so rank 0 drops a failed save at
once instead of waiting for the slowest rank. An entry is ``{"rank", "files", "results", "write_s"}`` when done (``results``: the
rank's DCP write results, pickled and base64-encoded, read back by the restricted unpickler of
:mod:`.integrity`) or ``{"rank", "error", "path"}`` when not.
Every key lives under a fresh ``save_id``, so restarts and reruns never collide. Entries of a save
rank 0 dropped before every rank posted (a failure elsewhere, a rebind) stay in the store: a few KB
a rank, only for saves that failed. :class:`LocalBoard` is the same board on a :class:`HashStore`,
for a single process without ``torch.distributed``.
"""

from __future__ import annotations

import base64
import json
from typing import NamedTuple

import torch.distributed as dist

from .integrity import safe_pickle_loads

FAILED = 1 << 32
"""What a failed post adds to the counter on top of 1."""


class Tally(NamedTuple):
    posted: int
    """Ranks that posted (done or failed)."""
    failed: int
    """Ranks whose post is a failure."""


class StoreBoard:
    """The completion board on ``store`` (see the module docs); no collective, no hidden process group."""

    def __init__(self, store, prefix: str = "nvrx_ckpt"):
        self.store, self.prefix = store, prefix

    def _key(self, save_id: str, name: str) -> str:
        return f"{self.prefix}/{save_id}/{name}"

    def post(self, save_id: str, rank: int, entry: dict) -> None:
        """Rank ``rank``'s outcome for ``save_id``: 2 store operations."""
        self.store.append(self._key(save_id, "posts"), json.dumps({**entry, "rank": rank}).encode() + b"\n")
        self.store.add(self._key(save_id, "n"), FAILED + 1 if "error" in entry else 1)

    def tally(self, save_id: str) -> Tally:
        """How many ranks posted, and how many of them failed: 1 store operation."""
        n = self.store.add(self._key(save_id, "n"), 0)
        return Tally(n % FAILED, n // FAILED)

    def count(self, save_id: str) -> int:
        """Ranks that posted so far: 1 store operation."""
        return self.tally(save_id).posted

    def collect(self, save_id: str) -> dict[int, dict]:
        """Every entry posted so far, by rank: 1 store operation (call it once ``count`` > 0)."""
        lines = self.store.get(self._key(save_id, "posts")).splitlines()
        return {e["rank"]: e for e in map(json.loads, filter(None, lines))}

    def forget(self, save_id: str) -> None:
        """Delete the save's keys (the store is the job's, and outlives many saves): 2 store operations."""
        for name in ("posts", "n"):
            self.store.delete_key(self._key(save_id, name))


class LocalBoard(StoreBoard):
    """The board of a single process (no ``torch.distributed``): the same code on an in-memory store."""

    def __init__(self, prefix: str = "nvrx_ckpt"):
        super().__init__(dist.HashStore(), prefix)


def group_board(group, prefix: str = "nvrx_ckpt") -> StoreBoard:
    """The board on ``group``'s own store (the store its ranks rendezvoused on)."""
    try:
        store = dist.distributed_c10d._get_process_group_store(group)
    except KeyError:
        raise ValueError(f"process_group {group!r} is not registered with torch.distributed: pass the world "
                         "group or one made by dist.new_group (its store carries the completion board)") from None
    return StoreBoard(store, prefix)


def done_entry(files: dict, results: bytes, write_s: float) -> dict:
    """A rank's done entry: its files (size, CRC32C chunks), pickled DCP write results, seconds."""
    return {"files": files, "results": base64.b64encode(results).decode(), "write_s": write_s}


def error_entry(error: str, path: str | None = None) -> dict:
    return {"error": error, "path": path}


def outcome_entry(kind: str, info: dict) -> dict:
    """The entry for a writer outcome ``(kind, step, info)`` of :meth:`.writer.WriterProcess.poll`."""
    if kind == "done":
        return done_entry(info["files"], info["results"], info["write_s"])
    if kind == "died":
        return error_entry(f"the writer process died ({info.get('why', 'unknown')})", info.get("tmp"))
    return error_entry(info.get("error", "unknown error"), info.get("path"))


def write_results(entry: dict) -> list:
    """The DCP write results of a done entry, unpickled by the restricted unpickler."""
    return safe_pickle_loads(base64.b64decode(entry["results"]))


__all__ = ["StoreBoard", "LocalBoard", "group_board", "Tally", "done_entry", "error_entry", "outcome_entry",
           "write_results"]
