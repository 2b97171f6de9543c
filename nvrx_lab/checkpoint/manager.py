"""The checkpoint manager: one object owns the intervals and the tiers (as torchtitan's ``CheckpointManager``).

A training loop calls :meth:`CheckpointManager.save` after every step and the manager decides::

    every step          commit what finished (rank 0: one store operation a save in flight)
    step % interval     a storage checkpoint, sync or async (AsyncCheckpointer)
    step % local        a local snapshot in node memory, replicated to the next node (LocalCheckpointer)

and :meth:`CheckpointManager.restore` loads the newest step from the nearest copy: this process's memory,
the node's shared memory, the next node's replica, else storage — whichever holds the newest step all ranks
can restore (local copies win only when they are at least as new as the newest committed storage step).
Settings come from one object, :class:`CheckpointConfig`, whose fields are the trainer's ``--ckpt*`` and
``--local-ckpt-*`` flags. The manager implements :class:`~.contracts.Checkpointer`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nvrx_lab.cli import Settings

from .checkpointer import AsyncCheckpointer
from .config import CheckpointerConfig
from .contracts import NO_HOOKS, IOHooks, LiveStateful
from .errors import CheckpointError
from .loading import Restored
from .local import LocalCheckpointer


@dataclass
class CheckpointConfig(Settings):
    """Checkpointing: which saves, how often, where (the trainer's ``--ckpt*`` and ``--local-ckpt-*`` flags)."""

    mode: Literal["none", "sync", "async"] = field(default="none", metadata={"flag": "ckpt"})
    """Checkpointing: none, sync (blocks every rank on storage) or async (stage, return, write in the background)."""
    interval: int = field(default=10, metadata={"flag": "ckpt-interval"})
    """Save every N steps."""
    wait_writer: bool = field(default=False, metadata={"flag": "ckpt-wait-writer"})
    """Async: wait for the writer process before the first step of a run that starts from scratch (a resumed
    attempt trains at once). Without it no save is dropped either: one taken while the writer starts is held,
    and the next save waits for it."""
    storage: CheckpointerConfig = field(default_factory=CheckpointerConfig)
    """Where and how storage checkpoints are written (``--ckpt-dir``, ``--ckpt-keep``, ``--ckpt-write-bandwidth``,
    ``--ckpt-writer-*``)."""
    local_interval: int = field(default=0, metadata={"flag": "local-ckpt-interval"})
    """Local checkpoints every N steps (0 = off): each rank's state in node memory, replicated to the same local
    rank of the next node, restored from the nearest copy after a fault (nvrx_lab.checkpoint.local). Needs
    --ckpt sync|async: storage checkpoints stay the durable fallback."""
    local_dir: str = field(default="/dev/shm/nvrx_lab_local", metadata={"flag": "local-ckpt-dir"})
    """Node-local, memory-backed folder of the local checkpoints (one subfolder per checkpoint folder; {node} in
    it becomes the node's index, for nodes simulated on one machine)."""
    local_grace: float = field(default=120.0, metadata={"flag": "local-ckpt-grace"})
    """Seconds the node's janitor keeps the local copies of a job killed whole once no process holds them (a
    replacement started within them restores from them)."""

    def __post_init__(self):
        if self.mode != "none":
            if not self.storage.directory:
                raise ValueError(f"--ckpt {self.mode} needs --ckpt-dir DIR (a folder shared by all ranks)")
            if self.interval < 1:
                raise ValueError(f"--ckpt-interval must be >= 1 step, got {self.interval}")
        if not self.local_grace > 0:
            raise ValueError(f"--local-ckpt-grace must be > 0 seconds, got {self.local_grace}")
        if self.local_interval < 0:
            raise ValueError(f"--local-ckpt-interval must be >= 0 steps (0 = off), got {self.local_interval}")
        if self.local_interval and self.mode == "none":
            raise ValueError("--local-ckpt-interval needs --ckpt sync|async and --ckpt-dir: storage checkpoints stay "
                             "the durable fallback (and name the run the local copies belong to)")
        if self.local_interval and Path(self.local_dir).is_file():
            raise ValueError(f"--local-ckpt-dir {self.local_dir} is a file; pass a folder in node memory "
                             "(e.g. /dev/shm/nvrx_lab_local; it is created if missing)")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class Placement:
    """Where this rank's local copies live and who its peers are (from the launch, not the flags)."""

    local_dir: Path
    """This run's folder of local checkpoints on this node."""
    run: str
    """The run's nonce: copies of another run are never restored."""
    local_world: int = 1
    """Ranks on this node: the peer holding a rank's replica is ``rank + local_world``."""


class CheckpointManager:
    """The storage and local tiers behind one :class:`~.contracts.Checkpointer` (see the module docs)."""

    def __init__(self, config: CheckpointConfig, group, emit: Callable, placement: Placement | None = None):
        self.config = config
        storage = dataclasses.replace(config.storage, start_writer=config.mode == "async", announce=False)
        self.storage = AsyncCheckpointer(config=storage, process_group=group, emit=emit)
        self.local: LocalCheckpointer | None = None
        if config.local_interval:
            if placement is None:
                raise ValueError("local checkpoints need a Placement (their node folder, the run, ranks per node)")
            self.local = LocalCheckpointer(placement.local_dir, run=placement.run, rank=self.storage.rank,
                                           world=self.storage.world, local_world=placement.local_world,
                                           group=self.storage.group, emit=emit, grace_s=config.local_grace)
        self._prepared = False

    @property
    def rank(self) -> int:
        return self.storage.rank

    # ------------------------------------------------------------------ restoring
    def restore(self, state: LiveStateful, io: IOHooks = NO_HOOKS) -> Restored | None:
        """Collective: the newest step from the nearest copy (local when it is at least as new as storage)."""
        with io.section("checkpoint_load"):
            storage_step = self.storage.latest_step()  # verified once: a local copy must be at least as new
            restored = self.local.restore(state, storage_step) if self.local is not None else None
            if restored is None and storage_step is not None:
                restored = self.storage.restore(state, step=storage_step)
                if self.local is not None and self.local.reached:
                    restored.rollback_steps = max(0, self.local.reached - restored.step)
            if restored is not None:
                io.during("load", restored.step)
        return restored

    def start_writer(self, io: IOHooks = NO_HOOKS, limit_s: float = 120.0) -> None:
        """Async: wait until the writer process is ready (``--ckpt-wait-writer``); waiting is progress."""
        if self.config.mode == "async":
            self.storage.start(timeout=limit_s)
        io.progress()

    # --------------------------------------------------------------------- saving
    def due(self, step: int) -> tuple[bool, bool]:
        """Whether ``step`` takes a storage checkpoint, and a local one."""
        local = bool(self.local is not None and step % self.config.local_interval == 0)
        return self.config.mode != "none" and step % self.config.interval == 0, local

    def save(self, state: LiveStateful, step: int, io: IOHooks = NO_HOOKS, force: bool = False) -> bool:
        storage, local = self.due(step)
        if self.config.mode == "async" and not self._prepared:  # the first save blocks no longer than the later ones
            self.storage.prepare(state.state_dict(), plan=True)  # every rank is here: the plan is collective
            self._prepared = True
        if storage or (force and self.config.mode != "none"):
            with io.section("checkpoint"):
                (self.storage.save if self.config.mode == "sync" else self.storage.async_save)(state.state_dict(), step)
                io.during("save", step)
            io.after_save()
        if local:
            with io.section("checkpoint_local"):
                self.local.save(state.local_state_dict(), step)
        try:  # in its own section: an in-process restart must not fall between a commit and its event
            with io.section("checkpoint_commit"):
                self.storage.finalize_async_save(blocking=False)
        except CheckpointError as e:  # already in the event stream; the previous checkpoint is intact
            print(f"[rank {self.rank}] checkpoint failed, training goes on: {e}", file=sys.stderr, flush=True)
        return storage or local or force

    def finish(self, io: IOHooks = NO_HOOKS) -> None:
        with io.section("checkpoint_finalize"):
            self.storage.finalize_async_save(blocking=True)

    # ------------------------------------------------------------------ lifecycle
    def rebind(self, group) -> None:
        self.storage.rebind(group)
        if self.local is not None:
            self.local.bind(self.storage.group, self.storage.rank, self.storage.world)
        self._prepared = False

    def close(self) -> None:
        try:
            self.storage.close()
        finally:
            if self.local is not None:
                self.local.close()

    def abandon(self) -> None:
        """A failed process: the node keeps its local copies for the replacement (or the janitor)."""
        try:
            self.storage.abandon()
        finally:
            if self.local is not None:
                self.local.close(keep=True)
