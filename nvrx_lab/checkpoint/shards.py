"""Writing one rank's shards with DCP's own file writer, metered and throttled.

:func:`write_shards` hands a final DCP plan to ``FileSystemWriter.write_data`` (one file per rank,
``__{rank}_0.distcp``, fsynced), so the bytes on disk are exactly what ``dcp.save`` would write and
``dcp.load`` reads them. Two things are swapped in: the writer's filesystem becomes
:class:`MeteredFileSystem` (every byte through :class:`~.throttle.MeteredStream`: bandwidth cap and
CRC32C on the fly), and the planner becomes :class:`_Resolver`, which serves each write item from a
dict — staged shared-memory views in the writer process, live tensors in a synchronous save.
An ``OSError`` (ENOSPC, EACCES, EFBIG) comes out as :class:`~.errors.CheckpointWriteError` naming the
step and the file. The folder is rank 0's (:func:`.commit.make_tmp`): a writer opens its one file and
touches no other name, so a save costs the filesystem one metadata operation per rank.
"""

from __future__ import annotations

import io
import pickle
import time
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .errors import CheckpointError, CheckpointWriteError
from .throttle import MeteredStream, Throttle


class MeteredFileSystem(FileSystem):
    """``FileSystem`` whose write streams are metered; ``files`` collects each file's manifest entry (size, chunk CRC32Cs)."""

    def __init__(self, throttle: Throttle):
        super().__init__()
        self.throttle = throttle
        self.files: dict[str, dict] = {}
        self.current: str | None = None
        self.stream: MeteredStream | None = None

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        self.current = str(path)
        with open(path, mode) as raw:
            stream = self.stream = MeteredStream(raw, self.throttle)
            yield stream
        self.files[Path(path).name] = stream.entry()


class _Resolver:
    """Stands in for the planner in ``write_data``: serves each write item's data from a dict."""

    def __init__(self, data: dict):
        self.data = data

    def resolve_data(self, item):
        value = self.data[item.index]
        return io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else value


def write_shards(tmp: Path, rank: int, plan, data: dict, bandwidth: float | None,
                 step: int) -> tuple[bytes, dict, float]:
    """Write this rank's items of ``plan`` into the existing folder ``tmp``; returns (pickled write results,
    files, seconds)."""
    t0 = time.monotonic()
    fs = MeteredFileSystem(Throttle(bandwidth))
    try:
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1,
                                  per_thread_copy_ahead=0)
        writer.fs = fs
        writer.set_up_storage_writer(False, rank=rank)
        results = writer.write_data(plan, _Resolver(data)).value()
        # the folder's entries are fsynced by the coordinator's commit, before the folder is renamed
    except Exception as exc:
        e = fs.stream.error if fs.stream is not None and fs.stream.error is not None else exc
        if not isinstance(e, OSError):
            raise
        e = _why_no_folder(tmp, e)
        path = e.filename or fs.current or str(tmp)
        raise CheckpointWriteError(f"step {step}: rank {rank} could not write {path}: "
                                   f"{e.strerror or e} (errno {e.errno})", step=step, path=str(path),
                                   errno=e.errno) from e
    return pickle.dumps(results), fs.files, time.monotonic() - t0


def _why_no_folder(tmp: Path, e: OSError) -> OSError:
    """A write into a folder that is not there: rank 0 could not create it. Try, to say why (EACCES…)."""
    if isinstance(e, FileNotFoundError) and not tmp.exists():
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as why:
            return why
    return e


def write_live(tmp: Path, rank: int, planned, bandwidth: float | None, step: int) -> tuple[str, dict]:
    """The synchronous save's write: this rank's shards straight from the live tensors of ``planned``
    (:func:`.planning.plan_save`). Returns the outcome as the writer process does: ("done", {results,
    files, write_s}) or ("error", {error, path})."""
    data = dict(zip((i.index for i in planned.tensor_items), planned.tensors, strict=True))
    data.update(planned.byte_items)
    try:
        results, files, write_s = write_shards(tmp, rank, planned.plan, data, bandwidth, step)
    except (CheckpointError, OSError) as e:
        return "error", {"error": str(e), "path": getattr(e, "path", None) or getattr(e, "filename", None)}
    return "done", {"results": results, "files": files, "write_s": write_s}
