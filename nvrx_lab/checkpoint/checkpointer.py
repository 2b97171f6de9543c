"""``AsyncCheckpointer``: stage, return to training, write in the background, commit atomically.

Timeline of one ``async_save(state, step=s)`` on every rank::

    trainer  | wait for the writer's previous save | plan (collective, cheap) | stage (copy) | return
    writer   |                                      ...write shards, fsync, answer (files, results)...
    reader   |                                      post the answer on the completion board (the store)
    rank 0   | finalize_async_save(): every rank posted? (1 store op) -> .metadata, manifest, rename

**A save asked while one is in flight waits** for this rank's writer to finish the previous one (the staging
buffer is reused, so memory stays at one copy of the state), then proceeds; the wait is reported as
``wait_s`` in the ``ckpt_save`` event. One writer per rank, one request at a time: never two writers on a step.

Collectives: ``async_save``, ``save``, ``latest_step``, ``load`` and ``restore`` are collective over the CPU
group when ``torch.distributed`` is initialised (call them on every rank); ``finalize_async_save`` is not —
it only polls the local writer and, on rank 0, the completion board (:mod:`.completion`: one store operation
while a save is pending, none otherwise, never the filesystem). Its errors are raised where they are seen
(the failing rank, and rank 0 for any rank), so a trainer may catch :class:`CheckpointError`, log it and go
on: the previous committed checkpoint stays the latest. Built step by step in ``notebooks/01_async_checkpointing.ipynb``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist

from . import commit as cm
from . import loading
from .completion import LocalBoard, error_entry, group_board, outcome_entry
from .config import CheckpointerConfig, check_step
from .errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CheckpointWriterDied
from .loading import Restored
from .planning import PlanCache, all_gather, broadcast, local_tensors, plan_save
from .shards import write_live
from .staging import StagingBuffer, plan_slots
from .throttle import check_bandwidth
from .writer import WriterProcess

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Asynchronous DCP checkpoints with a persistent writer process per rank (see module docs)."""

    def __init__(self, directory, keep_last: int = 3, write_bandwidth: float | None = None,
                 process_group=None, emit: Callable | None = None, **more):
        self.config = CheckpointerConfig(str(directory), keep_last, write_bandwidth, **more)
        self.root = Path(directory)
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"checkpoint directory {self.root} is a file; pass a folder path")
        if self.config.verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {self.config.verify!r}")
        self.config.write_bandwidth = check_bandwidth(write_bandwidth, "write_bandwidth")
        self.retention = cm.KeepLast(keep_last)
        self.emit = emit or (lambda kind, **fields: None)
        self.group, self.rank, self.world, self._board = None, 0, 1, LocalBoard()
        if dist.is_available() and dist.is_initialized():
            self._bind(process_group)
        self._buffer = StagingBuffer(tag=f"r{self.rank}")
        self._plans = PlanCache()  # the last plan, reused while the state keeps its structure
        self._writer = WriterProcess(self.rank, self.config.writer_priority) if self.config.start_writer else None
        self._pending: list[dict] = []  # rank 0: saves waiting to be committed, oldest first
        self._errors: list[CheckpointError] = []
        self._fallbacks_logged: set[tuple[int, str]] = set()
        self._closed = False

    # ----------------------------------------------------------------- saving
    writer_pid = property(lambda self: self._writer.pid if self._writer else None,
                          doc="PID of this rank's writer process (for fault-injection tests and notebooks).")
    _in_flight = property(lambda self: self._writer.in_flight if self._writer else None)

    def start(self, timeout: float = 120.0) -> AsyncCheckpointer:
        """Start the writer now and wait until it is ready (optional: ``async_save`` starts it on demand)."""
        if self._writer is None or not self._writer.alive():
            self._new_writer()
        if self._in_flight is None:
            self._writer.wait_ready(timeout)
        return self

    def prepare(self, state_dict: dict) -> AsyncCheckpointer:
        """Allocate and touch the staging memory for ``state_dict`` now (optional, local, no collective):
        the first ``async_save`` then blocks no longer than the later ones."""
        if self._buffer.ensure(plan_slots(local_tensors(state_dict))[1]):
            self._buffer.prefault()
        return self

    def async_save(self, state_dict: dict, step: int) -> None:
        """Stage ``state_dict`` and hand it to the writer; returns once training may mutate the state."""
        check_step(step)
        t0 = time.monotonic()
        if self._in_flight and (unsent := self._writer.take_unsent()) is not None:
            self._supersede(unsent, step)  # the writer is still starting (after a restart too): never wait for it
        if self._in_flight and self._in_flight["step"] == step:
            raise ValueError(f"step {step} is already being written to {self._in_flight['tmp']}")
        self._collect(self._writer.poll(timeout=1e9) if self._in_flight else None)
        wait_s = time.monotonic() - t0
        if self.rank == 0:
            self._commit_ready(blocking=False)
        if self._writer is None or not self._writer.alive():
            self._new_writer()
        planned = self._plan(state_dict, step)
        slots = self._buffer.stage(planned.tensors)
        tmp, board, sid, rank = cm.tmp_dir(self.root, step, planned.save_id), self._board, planned.save_id, self.rank
        self._writer.submit({"step": step, "tmp": str(tmp), "rank": rank, "plan": planned.plan, "save_id": sid,
                             "region": self._buffer.path, "tensor_items": planned.tensor_items, "slots": slots,
                             "byte_items": planned.byte_items, "bandwidth": self.config.write_bandwidth},
                            on_outcome=lambda kind, info: board.post(sid, rank, outcome_entry(kind, info)))
        if self.rank == 0:
            self._pending.append({"step": step, "tmp": tmp, "metadata": planned.metadata, "t0": t0, "save_id": sid})
        self.emit("ckpt_save", step=step, mode="async", blocking_s=time.monotonic() - t0, wait_s=wait_s,
                  bytes=planned.nbytes)

    def finalize_async_save(self, blocking: bool = False) -> list[int]:
        """Collect finished writes and (rank 0) commit them (``blocking``: all); returns the steps committed.
        Raises :class:`CheckpointError` (step, path) for a save that failed since the last call; the failed
        save is dropped and training can go on."""
        if self._in_flight:
            self._collect(self._writer.poll(timeout=1e9 if blocking else 0.0))
        committed = self._commit_ready(blocking) if self.rank == 0 else []
        self._raise_errors()
        return committed

    def save(self, state_dict: dict, step: int) -> None:
        """Synchronous baseline: same plan, files and commit, written from the live tensors; returns once durable."""
        check_step(step)
        t0 = time.monotonic()
        try:  # an earlier async save's error was logged and emitted; not raised here, so that every
            self.finalize_async_save(blocking=True)  # rank reaches the collective planning below
        except CheckpointError:
            pass
        planned = self._plan(state_dict, step)
        tmp = cm.tmp_dir(self.root, step, planned.save_id)
        kind, info = write_live(tmp, self.rank, planned, self.config.write_bandwidth, step)
        self._board.post(planned.save_id, self.rank, outcome_entry(kind, info))
        errors = all_gather(info.get("error"), self.group, self.world)
        if any(errors):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                self._board.forget(planned.save_id)
            raise self._report(CheckpointWriteError(f"sync save of step {step} failed: "
                                                    + "; ".join(e for e in errors if e), step=step, path=str(tmp)))
        if self.rank == 0:
            self._pending.append({"step": step, "tmp": tmp, "metadata": planned.metadata, "t0": t0, "save_id": planned.save_id})
            self._commit_ready(blocking=True)
        mine = [e for e in self._errors if e.step == step]
        self._errors = [e for e in self._errors if e.step != step]
        outcome = broadcast(str(mine[0]) if mine else None, self.group, self.world)
        if outcome:
            raise CheckpointWriteError(outcome, step=step, path=str(tmp))
        self.emit("ckpt_save", step=step, mode="sync", blocking_s=time.monotonic() - t0, wait_s=0.0,
                  bytes=planned.nbytes)

    # ---------------------------------------------------------------- loading
    def latest_step(self) -> int | None:
        """Newest committed checkpoint that verifies; falls back past corrupt ones, logging why."""
        return loading.latest_step(self.root, self.config.verify == "full", self.rank, self.group, self.world,
                                   self._fallback)

    def restore(self, state, step: int | None = None) -> Restored | None:
        """Load the newest committed step (``step``: it, found by :meth:`latest_step` already) into ``state``
        (a ``Stateful``: ``state_dict()`` asked only when there is one); collective. None: nothing to restore."""
        if (step := self.latest_step() if step is None else step) is not None:
            self.load(sd := state.state_dict(), step=step)
            state.load_state_dict(sd)
            return Restored(step, "storage")
        return None

    def load(self, state_dict: dict, step: int | None = None) -> int:
        """Load ``step`` (default: :meth:`latest_step`) into ``state_dict`` in place; returns the step."""
        t0 = time.monotonic()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(cm.describe_directory(self.root), path=str(self.root))
        folder = loading.check_step(self.root, step, self.config.verify == "full", self.rank, self.group, self.world)
        loading.load_folder(state_dict, folder, step, self.group, self.world)
        self.emit("ckpt_load", step=step, load_s=time.monotonic() - t0)
        return step

    # -------------------------------------------------------------- lifecycle
    def rebind(self, process_group=None) -> None:
        """Coordinate over a new process group (an in-process restart made one), keeping the writer
        process and the staging memory. Saves of the aborted attempt that were not committed yet are
        dropped: some of their ranks may be gone; their temporary folders are swept by a later commit."""
        self._bind(process_group)
        self._pending.clear()
        self._errors.clear()

    def close(self) -> None:
        """Finish (and commit) what is in flight, stop the writer, free the staging memory."""
        if self._closed:
            return
        self._closed = True
        try:
            self.finalize_async_save(blocking=True)
        finally:
            if self._writer is not None:
                self._writer.close()
            self._buffer.release()

    def abandon(self) -> int | None:
        """Stop at once after a failure or Ctrl-C: kill the writer mid-write, commit nothing more,
        free the staging memory. Returns the step that was in flight (its temporary folder is swept
        by a later commit); every committed checkpoint stays as it was."""
        if self._closed:
            return None
        self._closed = True
        lost = self._in_flight["step"] if self._in_flight else None
        if self._writer is not None:
            self._writer.process.kill()
            self._writer.close()
        self._buffer.release()
        for p in self._pending:
            shutil.rmtree(p["tmp"], ignore_errors=True)
        self._pending.clear()
        if lost is not None:
            log.warning("checkpoint step %d abandoned (interrupted); the committed checkpoints are intact", lost)
        return lost

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.abandon() if exc_type is KeyboardInterrupt else self.close()
        except CheckpointError:
            if exc_type is None:
                raise

    # -------------------------------------------------------------- internals
    def _plan(self, state_dict: dict, step: int):
        return plan_save(state_dict, self.rank, self.world, self.group, partial(cm.make_tmp, self.root, step),
                         cache=self._plans, unprepare=partial(cm.unmake_tmp, self.root, step))

    def _bind(self, process_group) -> None:
        """Coordinate over ``process_group`` (default: the world if it is gloo, else a new gloo group)."""
        self.group = process_group
        if self.group is None:
            self.group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._board = group_board(self.group)

    def _new_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._buffer.release()  # the old writer removed the region's name; the new writer maps a new one
        self._writer = WriterProcess(self.rank, self.config.writer_priority)

    def _supersede(self, unsent: dict, step: int) -> None:
        """Drop a save its writer never received (it was still starting) in favour of ``step``; the
        board tells rank 0, whose other ranks may have written it, to drop it too (``ckpt_skip``)."""
        reason = f"superseded by step {step}: the writer process of rank {self.rank} was still starting"
        self._board.post(unsent["save_id"], self.rank, error_entry(reason, unsent["tmp"], superseded=True))
        log.info("checkpoint step %d %s", unsent["step"], reason)

    def _collect(self, outcome) -> None:
        """This rank's side of a finished write (the reader thread posted it; rank 0 drops a failed save
        when it reads the board)."""
        if outcome is None:
            return
        self._buffer.unlink()  # the writer has mapped the region by now
        kind, step, info = outcome
        if kind == "error":
            self._report(CheckpointWriteError(f"async save of step {step} failed on rank {self.rank}: {info['error']}",
                                              step=step, path=info.get("path"), errno=info.get("errno")))
        elif kind == "died":
            tmp = Path(info["tmp"])
            self._report(CheckpointWriterDied(f"async save of step {step} failed: the writer process of rank "
                                              f"{self.rank} died ({info['why']}) while writing {tmp}",
                                              step=step, path=str(tmp)))

    def _commit_ready(self, blocking: bool) -> list[int]:
        return cm.commit_ready(self._pending, self.root, self._board, self.world, self.retention,
                               self.config.commit_timeout if blocking else 0.0, self._report, self.emit,
                               failed_steps={e.step for e in self._errors})

    def _report(self, error: CheckpointError) -> CheckpointError:
        log.error("%s", error)
        self.emit("ckpt_error", step=error.step, path=error.path, error=str(error))
        self._errors.append(error)
        return error

    def _raise_errors(self) -> None:
        if self._errors:
            errors, self._errors = self._errors, []
            raise errors[0]

    def _fallback(self, step: int, reason: str) -> None:
        if (step, reason) not in self._fallbacks_logged:
            self._fallbacks_logged.add((step, reason))
            log.warning("checkpoint step %d skipped: %s", step, reason)
            self.emit("ckpt_fallback", step=step, reason=reason)

