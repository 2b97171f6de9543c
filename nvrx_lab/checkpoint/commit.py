"""Commit protocol and retention: a checkpoint exists only once it is whole.

Layout of a checkpoint directory::

    D/step_00000020/            committed: DCP files + nvrx_commit.json
    D/step_00000030/
    D/.tmp_step_00000040_<id>/  a save in flight (or the debris of a crashed one)

1. Rank 0 creates the step's temporary folder while planning, before the plans reach the other
   ranks (:func:`make_tmp`). Every rank's writer writes its shards (``__{rank}_0.distcp``) into it,
   fsynced, and hands its write results and its files' sizes and CRC32C back to its trainer, which
   posts them on the completion board (:mod:`.completion`: the process group's store), or the
   error if the write failed. Nothing else is written per rank: no marker files.
2. The coordinator (rank 0) counts the posts (one store operation per ``finalize_async_save``
   while a save is pending, none otherwise, and no filesystem operation) and commits once every
   rank posted: it merges the write results into the global metadata and writes DCP's ``.metadata``
   (DCP's own ``FileSystemWriter.finish``), then the manifest ``nvrx_commit.json`` (every file's size
   and CRC32C), fsyncs the folder, renames it to ``step_XXXXXXXX`` and fsyncs ``D``. The folder
   rename is the atomic commit: a reader sees the whole checkpoint or none of it.
3. Retention then deletes older committed folders (a :class:`KeepLast` policy; each is renamed to
   ``.trash_*`` first, so a kill half-way never leaves a committed folder with files missing) and
   temporary folders of steps that are no longer in flight.

Metadata operations of one save: one ``open`` per shard file (N) and, at the coordinator, a
constant: the folder's ``mkdir``, ``.metadata`` (open, exists, rename), the manifest (open, rename),
two directory fsyncs, the folder's rename, one listing of ``D`` for retention (plus, when a
checkpoint is deleted, its own files). Multi-node jobs need ``D`` on a shared filesystem (FSx for
Lustre on EKS), as DCP does anyway.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from nvrx_lab import liveness
from nvrx_lab.net import wait_for

from .completion import Tally, write_results
from .errors import CheckpointWriteError
from .integrity import FORMAT, MANIFEST
from .shards import MeteredFileSystem
from .throttle import Throttle

STEP_RE = re.compile(r"^step_(\d{8,})$")
TMP_RE = re.compile(r"^\.tmp_step_(\d{8,})_([0-9a-f]+)$")
TRASH_PREFIX = ".trash_step_"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def tmp_dir(root: Path, step: int, save_id: str) -> Path:
    return Path(root) / f".tmp_step_{step:08d}_{save_id}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write and fsync ``path`` in a temporary folder: no ``.part`` + rename, as the folder's own
    rename is what makes it visible."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def make_tmp(root: Path, step: int, save_id: str) -> None:
    """Coordinator, while planning: create the save's temporary folder (and ``root``) for every rank's
    writer. Best effort: if it fails (a read-only folder), each writer reports why when it writes."""
    try:
        tmp_dir(root, step, save_id).mkdir(parents=True)
    except OSError:
        pass


def unmake_tmp(root: Path, step: int, save_id: str) -> None:
    """Coordinator: remove a folder :func:`make_tmp` created for a save that was planned anew."""
    try:
        tmp_dir(root, step, save_id).rmdir()
    except OSError:
        pass


def foreign_entries(root: Path) -> list[str]:
    """Names in ``root`` that no checkpointer wrote: not a committed step, a save in flight or trash."""
    ours = lambda name: STEP_RE.match(name) or TMP_RE.match(name) or name.startswith(TRASH_PREFIX)  # noqa: E731
    return sorted(p.name for p in Path(root).iterdir() if not ours(p.name))


def describe_directory(root: Path) -> str:
    """Why ``root`` holds no loadable checkpoint, for an error message."""
    root = Path(root)
    if not root.exists():
        return f"checkpoint directory {root} does not exist"
    entries = sorted(p.name for p in root.iterdir())
    if not entries:
        return f"checkpoint directory {root} is empty: nothing saved yet"
    if committed_steps(root):
        return f"no checkpoint in {root} passed verification (see the ckpt_fallback log lines)"
    return (f"{root} is not a checkpoint directory: it holds {entries[:5]} but no step_XXXXXXXX/ "
            f"folder with {MANIFEST} (written by AsyncCheckpointer)")


def commit(root: Path, step: int, tmp: Path, metadata, entries: dict[int, dict], world: int,
           replace: bool = True) -> dict:
    """Coordinator: merge the posted write results into ``.metadata``, write the manifest, rename ``tmp``
    to the step folder (see the module docs). ``replace``: the step may be committed already."""
    writer = FileSystemWriter(tmp, sync_files=True)
    writer.fs = MeteredFileSystem(Throttle(None))  # size and CRC32C of .metadata as it is written
    writer.finish(metadata=metadata, results=[write_results(entries[r]) for r in range(world)])
    files = {".metadata": writer.fs.files.pop(".metadata.tmp")}
    for r in range(world):
        files.update(entries[r]["files"])
    manifest = {"format": FORMAT, "step": step, "world_size": world, "committed_at": time.time(),
                "bytes": sum(f["size"] for f in files.values()), "files": files}
    write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)  # every rank's shard entry, .metadata and the manifest, before the folder is renamed
    final = step_dir(root, step)
    trash = to_trash(final) if replace else None  # re-saving a step (e.g. after a fallback from a corrupt one): swap it out
    os.rename(tmp, final)
    fsync_dir(Path(root))
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return manifest


def committed_steps(root: Path) -> list[int]:
    """Steps whose folder carries a manifest, ascending (not yet verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and (p / MANIFEST).exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


@dataclass
class KeepLast:
    """Retention policy: keep the newest ``n`` committed checkpoints (``n >= 1``)."""

    n: int = 3
    """How many committed checkpoints to keep; the newest is never deleted."""

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {self.n!r}")

    def __call__(self, steps: list[int]) -> list[int]:
        """Steps to delete, given the committed ``steps``."""
        return sorted(steps)[:-self.n]


def to_trash(folder: Path) -> Path | None:
    """Rename a committed folder out of the ``step_*`` namespace (atomic), so a kill while it is deleted
    leaves trash (swept by :func:`apply_retention`), never a "committed" step missing files. Returns the
    trash folder, or None if ``folder`` is not there."""
    trash = folder.with_name(f".trash_{folder.name}_{os.getpid()}_{uuid.uuid4().hex[:6]}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return None
    return trash


def discard(folder: Path) -> None:
    """Delete a committed folder, through :func:`to_trash`."""
    if (trash := to_trash(folder)) is not None:
        shutil.rmtree(trash, ignore_errors=True)


def apply_retention(root: Path, policy, in_flight: set[str], names: list[str] | None = None) -> list[int]:
    """Delete what ``policy`` drops (never the newest) and stale temporary folders; returns deleted steps.

    ``names``: the entries of ``root``, as the commit listed them (one listing serves both; every
    ``step_*`` folder there was renamed into place after its manifest). Without it, ``root`` is listed
    here and a step folder counts only if it holds a manifest (:func:`committed_steps`)."""
    root = Path(root)
    if names is None:
        names, steps = os.listdir(root), committed_steps(root)
    else:
        steps = sorted(int(m.group(1)) for name in names if (m := STEP_RE.match(name)))
    doomed = [s for s in policy(steps) if steps and s != steps[-1]]
    for s in doomed:
        discard(step_dir(root, s))
    newest = steps[-1] if steps else -1
    for name in names:
        m = TMP_RE.match(name)
        if (m and name not in in_flight and int(m.group(1)) <= newest) or name.startswith(TRASH_PREFIX):
            shutil.rmtree(root / name, ignore_errors=True)
    return doomed


def _tally(board, save_id: str, world: int, timeout: float) -> Tally:
    """The board's tally of one save; ``timeout`` > 0 waits that long for every rank or a failure."""
    settled = lambda t: t if t.failed or t.posted >= world else None  # noqa: E731
    tally = board.tally(save_id)
    if settled(tally) or not timeout:
        return tally
    try:
        return wait_for(lambda: settled(board.tally(save_id)), timeout, f"every rank's post of save {save_id}",
                        interval=0.02, on_poll=liveness.beat)
    except TimeoutError:
        return board.tally(save_id)


def _drop(p: dict, entries: dict[int, dict], tally: Tally, world: int, timeout: float, report,
          failed_steps: set) -> None:
    """A save that will not commit: remove its folder once no rank writes into it any more (else a
    later commit sweeps it), and say why — unless it failed here already."""
    if tally.posted >= world:
        shutil.rmtree(p["tmp"], ignore_errors=True)
    errors = sorted((r, e) for r, e in entries.items() if "error" in e and r != 0)  # rank 0's: reported where it happened
    if p["step"] in failed_steps or (entries.get(0, {}).get("error") and not errors):
        return
    if errors:
        r, info = errors[0]
        msg, path = f"save of step {p['step']} failed on rank {r}: {info['error']}", info.get("path")
    else:
        missing = sorted(set(range(world)) - set(entries))
        msg, path = (f"save of step {p['step']}: only {len(entries)} of {world} ranks finished within {timeout} s "
                     f"(missing: ranks {missing[:16]}{' ...' if len(missing) > 16 else ''})"), None
    report(CheckpointWriteError(msg, step=p["step"], path=path or str(p["tmp"])))


def commit_ready(pending: list[dict], root: Path, board, world: int, retention, timeout: float, report, emit,
                 failed_steps: set) -> list[int]:
    """Rank 0: commit the ``pending`` saves (oldest first) every rank posted on ``board``; returns their steps.

    A pending save costs one store operation a call and no filesystem operation until it is complete;
    no pending save costs nothing. ``timeout`` > 0 waits that long per save (blocking finalize). A
    save a rank failed, or still incomplete after a blocking wait, is dropped and passed to ``report``
    as a :class:`CheckpointWriteError` (unless its step already failed locally). Callable without a
    process group: ``board`` and ``world`` say everything (the scale model drives it).
    """
    committed = []
    while pending:
        p = pending[0]
        tally = _tally(board, p["save_id"], world, timeout)
        if not tally.failed and tally.posted < world and not timeout:
            break  # still writing: try again at the next finalize
        pending.pop(0)
        entries = board.collect(p["save_id"]) if tally.posted else {}
        board.forget(p["save_id"])
        if tally.failed or tally.posted < world:
            _drop(p, entries, tally, world, timeout, report, failed_steps)
            continue
        tmp, final = Path(p["tmp"]), step_dir(root, p["step"])
        try:
            names = os.listdir(root)  # one listing serves the commit and the retention
            manifest = commit(root, p["step"], tmp, p["metadata"], entries, world, replace=final.name in names)
        except OSError as e:
            report(CheckpointWriteError(f"commit of step {p['step']} failed: {e}", step=p["step"],
                                        path=e.filename or str(tmp), errno=e.errno))
            continue
        committed.append(p["step"])
        emit("ckpt_commit", step=p["step"], durable_s=time.monotonic() - p["t0"], bytes=manifest["bytes"])
        names = [n for n in names if n not in (tmp.name, final.name)] + [final.name]
        apply_retention(root, retention, {Path(q["tmp"]).name for q in pending}, names)
    return committed
