"""Reading back: the newest committed checkpoint that verifies, and loading one into a state dict.

Rank 0 looks at the folder and verifies (sizes, CRC32C, a metadata file that unpickles no code); what it
finds is broadcast over the CPU group, so every rank takes the same step or raises the same error.
Then ``dcp.load`` reads each rank's share, resharding to this world size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from . import commit as cm
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .integrity import SafeLoadPlanner, SafeReader, read_metadata, verify
from .planning import broadcast


@dataclass
class Restored:
    """What a resume restored, and from where."""

    step: int
    source: str
    """``storage`` (a committed checkpoint), or a local copy (:mod:`.local`): ``memory`` (this process's
    own), ``local`` (a file on this node, left by the process before) or ``peer`` (the next node's replica)."""
    rollback_steps: int | None = None
    """Steps between the newest snapshot any rank had committed and the step restored (a snapshot staged but
    not yet checksummed when its process died does not count); None when unknown (no local checkpoints:
    ``nvrx_lab.observe.goodput`` counts the redone steps from the events)."""


def latest_step(root: Path, full: bool, rank: int, group, world: int,
                fallback: Callable[[int, str], None]) -> int | None:
    """Newest committed step that verifies (``fallback(step, reason)`` hears of each one skipped)."""
    best = None
    if rank == 0:
        for step in reversed(cm.committed_steps(root)):
            try:
                verify(cm.step_dir(root, step), full=full)
                best = step
                break
            except CheckpointCorruptError as e:
                fallback(step, str(e))
    return broadcast(best, group, world)


def check_step(root: Path, step: int, full: bool, rank: int, group, world: int) -> Path:
    """The folder of committed ``step``, verified on rank 0; every rank raises the same error otherwise."""
    folder = cm.step_dir(root, step)
    problem = None
    if rank == 0:
        if not (folder / cm.MANIFEST).exists():
            found = cm.committed_steps(root)
            problem = ("notfound", f"no committed checkpoint for step {step} at {folder}; "
                       f"committed steps in {root}: {found or 'none'}")
        else:
            try:
                verify(folder, full=full)
                read_metadata(folder)  # refuses a crafted pickle before DCP opens it
            except CheckpointCorruptError as e:
                problem = ("corrupt", str(e), e.path)
    problem = broadcast(problem, group, world)
    if problem and problem[0] == "notfound":
        raise CheckpointNotFoundError(problem[1], step=step, path=str(folder))
    if problem:
        raise CheckpointCorruptError(f"cannot load step {step}: {problem[1]}", step=step, path=problem[2])
    return folder


def load_folder(state_dict: dict, folder: Path, step: int, group, world: int) -> None:
    """``dcp.load`` of a verified folder in place, with the safe reader and planner."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(),
                     process_group=group, no_dist=world == 1 and group is None)
    except (Exception, CheckpointException) as e:
        detail = "; ".join(f"rank {r}: {w[0] if isinstance(w, tuple) else w}"
                           for r, w in e.failures.items()) if isinstance(e, CheckpointException) else str(e)
        raise CheckpointError(f"loading step {step} from {folder} failed: {detail}", step=step,
                              path=str(folder)) from e
