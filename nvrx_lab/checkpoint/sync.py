"""The synchronous save: the async path's plan, files and commit, written from the live tensors.

The baseline every benchmark compares against (``--ckpt sync``): every rank writes its own shards
(:func:`.shards.write_live`) while training waits, rank 0 commits once every rank posted; a failure
on any rank raises :class:`~.errors.CheckpointWriteError` on every rank.
"""

from __future__ import annotations

import shutil
import time
from typing import TYPE_CHECKING

from . import commit as cm
from .completion import outcome_entry
from .config import check_step
from .errors import CheckpointError, CheckpointWriteError
from .planning import all_gather, broadcast
from .shards import write_live

if TYPE_CHECKING:
    from .checkpointer import AsyncCheckpointer


def save(ckpt: AsyncCheckpointer, state_dict: dict, step: int) -> None:
    """Save ``state_dict`` as ``step`` now, on every rank (collective); returns once it is committed."""
    check_step(step)
    t0 = time.monotonic()
    try:  # an earlier async save's error was logged and emitted; not raised here, so that every
        ckpt.finalize_async_save(blocking=True)  # rank reaches the collective planning below
    except CheckpointError:
        pass
    planned = ckpt._plan(state_dict, step)
    tmp = cm.tmp_dir(ckpt.root, step, planned.save_id)
    kind, info = write_live(tmp, ckpt.rank, planned, ckpt.config.write_bandwidth, step)
    ckpt._board.post(planned.save_id, ckpt.rank, outcome_entry(kind, info))
    errors = all_gather(info.get("error"), ckpt.group, ckpt.world)
    if any(errors):
        if ckpt.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            ckpt._board.forget(planned.save_id)
        raise ckpt._report(CheckpointWriteError(f"sync save of step {step} failed: "
                                                + "; ".join(e for e in errors if e), step=step, path=str(tmp)))
    if ckpt.rank == 0:
        ckpt._pending.add(step, tmp, planned.metadata, t0, planned.save_id)
        ckpt._pending.commit(ckpt.config.commit_timeout)
    mine = [e for e in ckpt._errors if e.step == step]
    ckpt._errors = [e for e in ckpt._errors if e.step != step]
    outcome = broadcast(str(mine[0]) if mine else None, ckpt.group, ckpt.world)
    if outcome:
        raise CheckpointWriteError(outcome, step=step, path=str(tmp))
    ckpt.emit("ckpt_save", step=step, mode="sync", blocking_s=time.monotonic() - t0, wait_s=0.0,
              bytes=planned.nbytes)

