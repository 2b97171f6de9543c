"""Commit protocol and retention: a checkpoint exists only once it is whole.

Layout of a checkpoint directory::

    D/step_00000020/            committed: DCP files + nvrx_commit.json
    D/step_00000030/
    D/.tmp_step_00000040_<id>/  a save in flight (or the debris of a crashed one)

1. Every rank's writer writes its shards (``__{rank}_0.distcp``) into the step's temporary folder,
   fsyncs them, then drops ``__{rank}.results.pkl`` (its DCP write results) and, last, the done
   marker ``__{rank}.done.json`` (sizes and CRC32 of its files). A failed writer drops
   ``__{rank}.error.json`` instead.
2. The coordinator (rank 0) commits once all done markers are there: it merges the write results
   into the global metadata and writes DCP's ``.metadata`` (DCP's own ``FileSystemWriter.finish``),
   then the manifest ``nvrx_commit.json`` (every file's size and CRC32), each fsynced and renamed
   into place, and finally renames the folder to ``step_XXXXXXXX`` and fsyncs ``D``. The folder
   rename is the atomic commit: a reader sees the whole checkpoint or none of it.
3. Retention then deletes older committed folders (a :class:`KeepLast` policy; each is renamed to
   ``.trash_*`` first, so a kill half-way never leaves a committed folder with files missing) and
   temporary folders of steps that are no longer in flight.

The markers travel through the checkpoint directory itself, so multi-node jobs need it on a shared
filesystem (FSx for Lustre on EKS), as DCP does anyway.
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

from .errors import CheckpointWriteError
from .integrity import FORMAT, MANIFEST, file_entry, safe_pickle_load

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


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` via ``path.part`` + fsync + rename."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def write_rank_done(tmp: Path, rank: int, results_pickle: bytes, files: dict, write_s: float) -> None:
    write_atomic(tmp / f"__{rank}.results.pkl", results_pickle)
    info = {"rank": rank, "files": files, "bytes": sum(f["size"] for f in files.values()), "write_s": write_s}
    fsync_dir(tmp)
    write_atomic(tmp / f"__{rank}.done.json", json.dumps(info).encode())


def write_rank_error(tmp: Path, rank: int, info: dict) -> bool:
    """Best effort (the disk may be full): True if the marker was written."""
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        write_atomic(tmp / f"__{rank}.error.json", json.dumps(info).encode())
        return True
    except OSError:
        return False


def rank_status(tmp: Path, world: int) -> tuple[dict[int, dict], dict[int, dict]]:
    """(done markers, error markers) found in ``tmp``, by rank."""
    done, errors = {}, {}
    for r in range(world):
        for name, into in ((f"__{r}.done.json", done), (f"__{r}.error.json", errors)):
            p = tmp / name
            if p.exists():
                try:
                    into[r] = json.loads(p.read_text())
                except (OSError, json.JSONDecodeError):
                    pass
    return done, errors


def wait_for_ranks(tmp: Path, world: int, timeout: float) -> tuple[dict[int, dict], dict[int, dict]]:
    """:func:`rank_status`, polled until every rank is done, one failed, or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while True:
        done, errors = rank_status(tmp, world)
        if errors or len(done) == world or time.monotonic() >= deadline:
            return done, errors
        time.sleep(0.02)


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


def commit(root: Path, step: int, tmp: Path, metadata, world: int) -> dict:
    """Coordinator: merge results, write ``.metadata`` + manifest, rename ``tmp`` to the step folder."""
    done, _ = rank_status(tmp, world)
    results = [safe_pickle_load(tmp / f"__{r}.results.pkl") for r in range(world)]
    FileSystemWriter(tmp, sync_files=True).finish(metadata=metadata, results=results)
    files = {".metadata": file_entry(tmp / ".metadata")}
    for r in range(world):
        files.update(done[r]["files"])
    manifest = {"format": FORMAT, "step": step, "world_size": world, "committed_at": time.time(),
                "bytes": sum(f["size"] for f in files.values()), "files": files}
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    for r in range(world):
        for name in (f"__{r}.results.pkl", f"__{r}.done.json"):
            (tmp / name).unlink(missing_ok=True)
    final = step_dir(root, step)
    trash = to_trash(final)  # re-saving a step (e.g. after a fallback from a corrupt one): swap it out
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


def apply_retention(root: Path, policy, in_flight: set[str]) -> list[int]:
    """Delete what ``policy`` drops (never the newest) and stale temporary folders; returns deleted steps."""
    root = Path(root)
    steps = committed_steps(root)
    doomed = [s for s in policy(steps) if steps and s != steps[-1]]
    for s in doomed:
        discard(step_dir(root, s))
    newest = steps[-1] if steps else -1
    for p in root.iterdir():
        m = TMP_RE.match(p.name)
        if m and p.name not in in_flight and int(m.group(1)) <= newest:
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(TRASH_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
    return doomed


def commit_ready(pending: list[dict], root: Path, world: int, retention, timeout: float, report, emit,
                 failed_steps: set) -> list[int]:
    """Rank 0: commit the ``pending`` saves (oldest first) whose ranks are all done; returns their steps.

    ``timeout`` > 0 waits that long per save (blocking finalize). A save with an error marker, or
    still incomplete after a blocking wait, is dropped and passed to ``report`` as a
    :class:`CheckpointWriteError` (unless its step already failed locally).
    """
    committed = []
    while pending:
        p = pending[0]
        done, errors = wait_for_ranks(p["tmp"], world, timeout)
        if not errors and len(done) < world and not timeout:
            break  # still writing: try again at the next finalize
        pending.pop(0)
        if errors or len(done) < world:
            shutil.rmtree(p["tmp"], ignore_errors=True)
            if errors and all(e.get("superseded") for e in errors.values()):  # a newer save took its place
                emit("ckpt_skip", step=p["step"], reason=next(iter(errors.values()))["error"])
                continue
            if p["step"] not in failed_steps:
                if errors:
                    r, info = sorted(errors.items())[0]
                    msg, path = f"save of step {p['step']} failed on rank {r}: {info.get('error')}", info.get("path")
                else:
                    msg, path = (f"save of step {p['step']}: only ranks {sorted(done)} of {world} finished "
                                 f"within {timeout} s"), None
                report(CheckpointWriteError(msg, step=p["step"], path=path or str(p["tmp"])))
            continue
        try:
            manifest = commit(root, p["step"], p["tmp"], p["metadata"], world)
        except OSError as e:
            report(CheckpointWriteError(f"commit of step {p['step']} failed: {e}", step=p["step"],
                                        path=e.filename or str(p["tmp"]), errno=e.errno))
            continue
        committed.append(p["step"])
        emit("ckpt_commit", step=p["step"], durable_s=time.monotonic() - p["t0"], bytes=manifest["bytes"])
        apply_retention(root, retention, {Path(q["tmp"]).name for q in pending})
    return committed
