"""Asynchronous checkpointing (``nvrx_lab.checkpoint``), in the format of torch.distributed.checkpoint.

Use::

    from nvrx_lab.checkpoint import AsyncCheckpointer

    with AsyncCheckpointer("ckpt/", keep_last=3) as ckpt:
        if (step := ckpt.latest_step()) is not None:
            ckpt.load(state, step=step)           # in place; reshards to this world size
        for step in range(start, steps):
            train_step()
            ckpt.finalize_async_save()            # commit what finished; raises a failed save's error
            if step % interval == 0:
                ckpt.async_save(state, step=step)  # returns once the state is staged

**Inside an in-process restart wrapper** (:class:`nvrx_lab.inprocess.Wrapper`) two patterns work:

* one checkpointer per attempt, ``with AsyncCheckpointer(...) as ckpt:`` inside the wrapped function,
  made after ``call_wrapper.init_process_group``: a fault leaving the ``with`` abandons the save in flight
  (no wait on a writer), a clean exit commits it;
* one checkpointer for every attempt (what :mod:`nvrx_lab.train` does): made in the first attempt, then
  ``ckpt.rebind(dist.group.WORLD)`` at the start of each later one, and ``close()`` after the wrapper
  returns. The writer process and the staging memory survive restarts.

Either way: ``restore(state)`` at the start of every attempt, saves inside ``call_wrapper.atomic()``.
A checkpointer made before ``init_process_group`` in a job of several ranks is an error (it would save as
rank 0 of 1 on every rank).

How it works, one module a mechanism:

* :mod:`.planning` — DCP's save plan, made collectively in ``async_save`` (cheap, no tensor data);
* :mod:`.staging` — a consistent snapshot: copies into reused shared-memory (pinned on GPUs) slots;
* :mod:`.writer` — one persistent spawned writer process per rank; :mod:`.shards` — DCP's file
  writer on the staged copy, with :mod:`.throttle` (bandwidth cap, on-the-fly CRC32C);
* :mod:`.completion` — the completion board: each rank posts its outcome on the process group's
  store, rank 0 counts the posts (no filesystem polling);
* :mod:`.commit` — temporary folder, atomic rename by rank 0, retention;
* :mod:`.integrity` — checksums, verification, a reader that never unpickles code; :mod:`.loading` —
  the newest step that verifies, fallback past corrupt ones, ``dcp.load`` of it;
* :mod:`.errors` — what ``finalize_async_save`` and ``load`` raise; :mod:`.checkpointer` — the API,
  :mod:`.config` — its knobs;
* the second half, local checkpoints: :mod:`.local` — every few steps each rank's shards in node memory,
  replicated to the next node, restored from the nearest copy; :mod:`.snapshot` — their format;
  :mod:`.janitor` — what removes a killed job's copies;
* what a caller needs: :mod:`.contracts` (``Stateful``, ``LiveStateful``, ``IOHooks``, ``Checkpointer``) and
  :mod:`.manager` (``CheckpointManager``: the intervals and both tiers behind ``Checkpointer``, configured by
  one ``CheckpointConfig``, the trainer's ``--ckpt*`` flags).

How DCP's collectives are split. ``dcp.save`` gathers plans, writes, then gathers write results for
the coordinator's ``.metadata``. Here the trainer runs the planning collectively inside
``async_save`` (cheap: shapes, no data; :mod:`.planning`), each rank's writer process writes its own
shards from the staged copy and hands its write results to its trainer, which posts them on the
store (:mod:`.writer`, :mod:`.completion`), and rank 0 merges them into ``.metadata`` at commit
(:mod:`.commit`). No collective runs in the background,
and no rank gathers another's tensors.

A checkpoint folder ``step_XXXXXXXX`` is a plain DCP checkpoint: ``dcp.load(sd, checkpoint_id=folder)``
reads it, on any world size. The notebook ``notebooks/01_async_checkpointing.ipynb`` builds it step
by step.
"""

from .checkpointer import AsyncCheckpointer
from .commit import KeepLast, committed_steps, step_dir
from .config import CheckpointerConfig
from .contracts import NO_HOOKS, Checkpointer, IOHooks, LiveStateful, Stateful
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CheckpointWriterDied
from .integrity import verify
from .loading import Restored
from .manager import CheckpointConfig, CheckpointManager, Placement
from .priority import WriterPriority
from .throttle import Throttle

__all__ = ["AsyncCheckpointer", "CheckpointerConfig", "CheckpointConfig", "CheckpointManager", "Placement", "Checkpointer",
           "IOHooks", "LiveStateful", "NO_HOOKS", "Restored", "Stateful", "KeepLast", "committed_steps", "step_dir", "verify",
           "Throttle", "CheckpointError", "CheckpointWriteError", "CheckpointWriterDied", "CheckpointCorruptError",
           "CheckpointNotFoundError", "WriterPriority"]
