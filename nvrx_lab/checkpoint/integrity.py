"""Integrity: checksums per shard, verification, and loading that never unpickles code.

Every committed checkpoint folder holds a manifest, ``nvrx_commit.json`` (see :mod:`.commit`), with
the size and CRC32C (:mod:`.checksum`) of every file in it, the DCP ``.metadata`` included. The CRC of a shard is computed
while the writer streams it (:class:`.throttle.MeteredStream`), so it costs no second read at save
time; :func:`verify` re-reads the files and compares, 16 MiB chunks on all cores in parallel.
Results are cached by ``(path, size, mtime)``,
so asking ``latest_step()`` twice reads the files once, and a file changed since is read again.

Safe loading. DCP stores its ``.metadata`` with :mod:`pickle`, and ``DefaultLoadPlanner`` loads
non-tensor values with ``torch.load(weights_only=False)``. :class:`SafeReader` and
:class:`SafeLoadPlanner` close both doors: the metadata goes through :class:`RestrictedUnpickler`
(DCP's metadata classes, ``torch.Size``, dtypes, ``pathlib`` paths; anything else, such as
``os.system`` in a crafted file, is refused) and values through ``torch.load(weights_only=True)``.
Tensors are read straight into the state's memory (:mod:`.direct_read`; their pickles with
``weights_only=True``), or by DCP itself with ``weights_only=True`` where they cannot be.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from .checksum import KEY, crc32c, of_entry
from .direct_read import read_into
from .errors import CheckpointCorruptError
from .throttle import VERIFY_CHUNK

MANIFEST = "nvrx_commit.json"
"""The commit marker and checksum list of one checkpoint folder."""
FORMAT = "nvrx_lab.checkpoint/2"
FORMATS = ("nvrx_lab.checkpoint/1", FORMAT)
"""Formats this version reads: /1 checksums with zlib's CRC32, /2 with CRC32C."""

_SAFE_MODULES = ("torch.distributed.checkpoint.metadata",)
_SAFE_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.storage", "WriteResult"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "Path"), ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and write results only; any other global raises ``UnpicklingError``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_NAMES:
            return super().find_class(module, name)
        if module in _SAFE_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle global {module}.{name}: not checkpoint metadata")


def safe_pickle_load(path: str | os.PathLike) -> Any:
    with open(path, "rb") as f:
        return RestrictedUnpickler(f).load()


def safe_pickle_loads(data: bytes) -> Any:
    """:func:`safe_pickle_load` of bytes (write results posted on the completion board)."""
    return RestrictedUnpickler(io.BytesIO(data)).load()


def _chunk_crc(path: str, offset: int, length: int, fn=crc32c) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        crc, done = 0, 0
        while done < length:
            data = os.pread(fd, min(length - done, 4 << 20), offset + done)
            if not data:
                break
            crc = fn(data, crc)
            done += len(data)
        return crc
    finally:
        os.close(fd)


def file_entry(path: str | os.PathLike) -> dict:
    """The manifest entry (size, per-chunk CRC32C) of a file written without a MeteredStream."""
    size = os.path.getsize(path)
    crcs = [_chunk_crc(str(path), off, min(VERIFY_CHUNK, size - off)) for off in range(0, size, VERIFY_CHUNK)]
    return {"size": size, "chunk_bytes": VERIFY_CHUNK, KEY: crcs}


_verified: set[tuple[str, int, int, int]] = set()
_pool = ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1), thread_name_prefix="nvrx-verify")


def _check_crcs(files: list[tuple[Path, dict]], step) -> None:
    """Compare every chunk's checksum in parallel (the GIL is released); raise for the first bad file."""
    jobs = []
    for path, entry in files:
        try:
            name, crcs, fn = of_entry(entry)
        except KeyError as e:
            raise CheckpointCorruptError(f"{path.parent / MANIFEST}: {path.name}: {e.args[0]}", step=step,
                                         path=str(path)) from None
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns, hash(tuple(crcs)))
        if key in _verified:
            continue
        n, size = entry["chunk_bytes"], entry["size"]
        futs = [_pool.submit(_chunk_crc, str(path), i * n, min(n, size - i * n), fn) for i in range(len(crcs))]
        jobs.append((path, name, key, futs, crcs, n, size))
    for path, name, key, futs, crcs, n, size in jobs:
        bad = [i for i, (fut, crc) in enumerate(zip(futs, crcs, strict=True)) if fut.result() != crc]
        if bad:
            raise CheckpointCorruptError(f"{path}: {name} mismatch in {_chunk_range(bad, n, size)}: corrupted",
                                         step=step, path=str(path))
        _verified.add(key)


def _chunk_range(bad: list[int], n: int, size: int) -> str:
    """Where the first bad chunk lies in its file, e.g. ``bytes 16777216-33554431 of 40000000 (chunk 2 of 3,
    16777216 B each)``: the checksums cover whole chunks, so the damage is somewhere in that range."""
    first = bad[0] * n
    more = f"; {len(bad) - 1} more bad chunk(s) after it" if len(bad) > 1 else ""
    return (f"bytes {first}-{min(first + n, size) - 1} of {size} (chunk {bad[0] + 1} of {-(-size // n)}, "
            f"{n} B each{more})")


def read_manifest(step_dir: str | os.PathLike) -> dict:
    path = Path(step_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: commit marker missing (not committed or damaged)", path=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{path}: commit marker unreadable ({e})", path=str(path)) from e
    if manifest.get("format") not in FORMATS or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorruptError(f"{path}: not an nvrx_lab commit marker (format {manifest.get('format')!r}, "
                                     f"expected one of {list(FORMATS)})", path=str(path))
    return manifest


def verify(step_dir: str | os.PathLike, full: bool = True) -> dict:
    """Check every file listed in the manifest (size, and checksums if ``full``); return the manifest.

    Raises :class:`CheckpointCorruptError` whose ``path`` is the first bad file.
    """
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)
    step = manifest.get("step")
    if ".metadata" not in manifest["files"]:
        raise CheckpointCorruptError(f"{step_dir / MANIFEST}: lists no .metadata", step=step, path=str(step_dir))
    files = []
    for name, entry in sorted(manifest["files"].items()):
        path = step_dir / name
        if not path.is_file():
            raise CheckpointCorruptError(f"{path}: file missing", step=step, path=str(path))
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointCorruptError(f"{path}: size {size} B, expected {entry['size']} B (truncated?)",
                                         step=step, path=str(path))
        files.append((path, entry))
    if full:
        _check_crcs(files, step)
    return manifest


def read_metadata(step_dir: str | os.PathLike):
    """DCP ``Metadata`` of a checkpoint folder, unpickled with :class:`RestrictedUnpickler`."""
    path = Path(step_dir) / ".metadata"
    try:
        return safe_pickle_load(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: file missing", path=str(path)) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: {e}", path=str(path)) from e


class SafeReader(FileSystemReader):
    """DCP's file reader with the ``.metadata`` read by :class:`RestrictedUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            metadata = safe_pickle_load(path)
        except pickle.UnpicklingError as e:
            raise CheckpointCorruptError(f"{path}: {e}", path=str(path)) from e
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """Tensors straight into the state's memory (:mod:`.direct_read`); whatever cannot be, DCP's way."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        left = []
        for relative, items in per_file.items():
            left += read_into(str(self.fs.concat_path(self.path, relative)), items, planner, self.storage_data)
        return super().read_data(dataclasses.replace(plan, items=left), planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


__all__ = ["MANIFEST", "FORMAT", "RestrictedUnpickler", "safe_pickle_load", "safe_pickle_loads", "file_entry", "verify",
           "read_manifest", "read_metadata", "SafeReader", "SafeLoadPlanner"]
