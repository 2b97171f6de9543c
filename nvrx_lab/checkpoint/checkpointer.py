"""``AsyncCheckpointer``: stage, return to training, write in the background, commit atomically.

Timeline of one ``async_save(state, step=s)`` on every rank::

    trainer  | wait for the writer's previous save | plan (collective, cheap) | stage (copy) | return
    writer   |                                      ...write shards, fsync, answer (files, results)...
    reader   |                                      post the answer on the completion board (the store)
    rank 0   | finalize_async_save(): every rank posted? (1 store op) -> .metadata, manifest, rename

**A save asked while one is in flight waits** for this rank's writer to finish the previous one (the staging
buffer is reused: one copy of the state), reported as ``wait_s`` in the ``ckpt_save`` event. One writer per
rank, one request at a time. A save is never dropped because its writer is still starting: it is held and
sent the moment the writer is ready, and the next save waits for it (a forked writer is ready in
milliseconds, a new interpreter in ~2 s: :mod:`.writer_main`), saying so on rank 0's console. Every wait
beats :mod:`nvrx_lab.liveness`, so the in-process restart wrapper does not take it for a hang; the package
docs (:mod:`nvrx_lab.checkpoint`) show the two patterns that work inside that wrapper.

Collectives: ``async_save``, ``save``, ``latest_step``, ``load`` and ``restore`` are collective over the CPU
group (call them on every rank); ``finalize_async_save`` is not: it polls the local writer and, on rank 0,
the completion board (:mod:`.completion`: one store operation while a save is pending, never the filesystem),
and raises a failed save's :class:`CheckpointError` where it is seen; the previous checkpoint stays the latest.
Built step by step in ``notebooks/01_async_checkpointing.ipynb``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist

from . import commit as cm
from . import loading, sync
from .completion import LocalBoard, group_board, outcome_entry
from .config import CheckpointerConfig, check_initialised, check_step
from .errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CheckpointWriterDied
from .loading import Restored
from .pending import PendingSaves, stopped_line
from .planning import PlanCache, local_tensors, plan_save
from .staging import StagingBuffer, plan_slots
from .writer import WriterProcess

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Asynchronous DCP checkpoints with a persistent writer process per rank (see module docs)."""

    def __init__(self, directory=None, keep_last: int = 3, write_bandwidth: float | None = None,
                 process_group=None, emit: Callable | None = None, *, config: CheckpointerConfig | None = None, **more):
        """Either the knobs one by one (``directory``, ``keep_last``, ... and :class:`CheckpointerConfig`'s other
        fields as keywords), or a whole ``config``."""
        self.config = config or CheckpointerConfig(str(directory or ""), keep_last, write_bandwidth or 0.0, **more)
        if not self.config.directory:
            raise ValueError("AsyncCheckpointer needs a directory (the folder of the checkpoints, shared by all ranks)")
        self.root = Path(self.config.directory)
        self.retention = cm.KeepLast(self.config.keep_last)
        self.emit = emit or (lambda kind, **fields: None)
        self._errors: list[CheckpointError] = []
        self._pending = PendingSaves(self.root, self.retention, self._report, self.emit,
                                     lambda: {e.step for e in self._errors})  # rank 0's saves waiting to commit
        self.group, self.rank, self.world, self._board = None, 0, 1, LocalBoard()
        self._pending.bind(self._board, 1)
        if check_initialised(self.root, process_group):
            self._bind(process_group)
        self._buffer = StagingBuffer(tag=f"r{self.rank}")
        self._plans = PlanCache()  # the last plan, reused while the state keeps its structure
        self._writer: WriterProcess | None = None
        self._fallbacks_logged: set[tuple[int, str]] = set()
        self._closed = False
        if self.config.start_writer:
            self._new_writer()

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

    def prepare(self, state_dict: dict, plan: bool = False) -> AsyncCheckpointer:
        """Allocate and touch the staging memory for ``state_dict`` now (optional; local, no collective), and with
        ``plan`` also make DCP's save plan now (a collective: every rank calls it), which the saves reuse while the
        state keeps its structure: the first ``async_save`` then blocks no longer than the later ones."""
        if self._buffer.ensure(plan_slots(local_tensors(state_dict))[1]):
            self._buffer.prefault()
        if plan and self._plans.central is None:
            plan_save(state_dict, self.rank, self.world, self.group, cache=self._plans)  # no folder: no save yet
        return self

    def async_save(self, state_dict: dict, step: int) -> None:
        """Stage ``state_dict`` and hand it to the writer; returns once training may mutate the state."""
        check_step(step)
        t0 = time.monotonic()
        if self._in_flight and self._in_flight["step"] == step:
            raise ValueError(f"step {step} is already being written to {self._in_flight['tmp']}")
        if self._in_flight:
            self._wait_in_flight(before=step)
        wait_s = time.monotonic() - t0
        if self.rank == 0:
            self._pending.commit()
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
            self._pending.add(step, tmp, planned.metadata, t0, sid)
        self.emit("ckpt_save", step=step, mode="async", blocking_s=time.monotonic() - t0, wait_s=wait_s,
                  bytes=planned.nbytes)

    def _wait_in_flight(self, before: int | None = None) -> None:
        """Wait for this rank's save in flight: its writer's start, then its write (:meth:`.WriterProcess.wait`)."""
        held = self._in_flight["step"]
        outcome, start_wait_s = self._writer.wait(self.config.commit_timeout)
        if start_wait_s > 0.1 and self.rank == 0:
            why = f"the save of step {before}" if before is not None else "the final commit"
            print(f"[rank 0] checkpoint: {why} waited {start_wait_s:.2f} s for the writer process to start (step {held} "
                  "was held, not dropped, meanwhile)", flush=True)
        self._collect(outcome)

    def finalize_async_save(self, blocking: bool = False) -> list[int]:
        """Collect finished writes and (rank 0) commit them (``blocking``: all); returns the steps committed.
        Raises :class:`CheckpointError` (step, path) for a save that failed since the last call; the failed
        save is dropped and training can go on."""
        if self._in_flight:
            if blocking:
                self._wait_in_flight()
            else:
                self._collect(self._writer.poll(timeout=0.0))
        committed = self._pending.commit(self.config.commit_timeout if blocking else 0.0) if self.rank == 0 else []
        self._raise_errors()
        return committed

    def save(self, state_dict: dict, step: int) -> None:
        """Synchronous baseline: same plan, files and commit, written from the live tensors; returns once durable
        (:func:`.sync.save`)."""
        sync.save(self, state_dict, step)

    # ---------------------------------------------------------------- loading
    def latest_step(self) -> int | None:
        """Newest committed checkpoint that verifies; falls back past corrupt ones, logging why."""
        return loading.latest_step(self.root, self.config.verify == "full", self.rank, self.group, self.world,
                                   self._fallback)

    def restore(self, state, step: int | None = None) -> Restored | None:
        """Load the newest committed step (``step``: it, found by :meth:`latest_step` already) into ``state``
        (a ``Stateful``: ``state_dict()`` asked only when there is one); collective. None: nothing to restore."""
        if (step := self.latest_step() if step is None else step) is not None:
            t0 = time.monotonic()
            self.load(sd := state.state_dict(), step=step)
            state.load_state_dict(sd)
            self._announce(f"resumed step {step} from {cm.step_dir(self.root, step)} ({time.monotonic() - t0:.2f} s)")
            return Restored(step, "storage")
        self._announce(f"nothing committed in {self.root}: starting from scratch")
        return None

    def _announce(self, line: str) -> None:
        """One console line on rank 0 for what a restore did (``announce=False``: the caller says it)."""
        if self.config.announce and self.rank == 0:
            print(f"[rank 0] checkpoint: {line}", flush=True)

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
        """Coordinate over a new process group (an in-process restart made one), keeping the writer and the
        staging memory. If every rank is still there, the old rank 0 first commits the saves being written (the
        writers outlive the restart), waiting at most twice as long as the last save took; the rest are dropped."""
        same_world = process_group is not None and dist.get_world_size(process_group) == self.world
        self._pending.settle(min(self.config.commit_timeout, 2 * self._pending.durable_s) if same_world else 0.0)
        self._bind(process_group)
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
        """Stop at once after a failure or Ctrl-C: commit what every rank finished (rank 0), kill the writer
        mid-write, free the staging memory; returns the step that was in flight (a later commit sweeps it)."""
        if self._closed:
            return None
        self._closed = True
        lost = self._in_flight["step"] if self._in_flight else None
        committed: list[int] = []
        if self.rank == 0 and self._pending:
            with contextlib.suppress(Exception):  # the group's store may be gone: then nothing more commits
                committed = self._pending.commit()
        if self._writer is not None:
            self._writer.process.kill()
            self._writer.close()
        self._buffer.release()
        self._pending.drop()
        if lost is not None:
            print(f"[rank {self.rank}] checkpoint: {stopped_line(self.rank, lost, committed)}", file=sys.stderr,
                  flush=True)
        return lost

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """A clean exit commits the save in flight (:meth:`close`); an exception, a Ctrl-C or an in-process
        restart's interrupt abandons it at once (:meth:`abandon`): waiting on a writer then would only hide
        the real error behind a hang."""
        if exc_type is not None:
            self.abandon()
            return
        self.close()

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
        self._pending.bind(self._board, self.world)

    def _new_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._buffer.release()  # the old writer removed the region's name; the new writer maps a new one
        self._writer = WriterProcess(self.rank, self.config.writer_priority, fork=self.config.fork_writer)

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

