"""Reading a DCP checkpoint's tensors straight into the state's own memory.

DCP's ``FileSystemReader`` loads every tensor item the way ``torch.load`` does: a new storage is
allocated and filled from the file, then copied into the state's tensor. That is two passes over the bytes
and a checkpoint-sized allocation. A DCP tensor item is one ``torch.save`` archive; its storage is a
record stored uncompressed at a known offset. So :func:`read_into` reads the archive's small pickle
(``map_location="meta"``: dtype, shape, strides, no data), finds the record's offset, and ``preadv``\\ s the
bytes into the destination tensor: one pass, no allocation. Items are read in parallel (``preadv``
releases the GIL). An item it cannot place that way (bytes, a transform, a non-contiguous layout, a
reshard that is not a run of whole rows) goes through DCP's own path, unchanged.

Nothing here unpickles code: the pickle is read by torch's weights-only unpickler.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch.distributed.checkpoint.planner import LoadItemType

_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="nvrx-read")


class _FileView(io.RawIOBase):
    """``length`` bytes of file descriptor ``fd`` from ``offset``, read with ``pread`` (no shared position)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.length - self.pos)
        if n <= 0:
            return 0
        data = os.pread(self.fd, n, self.offset + self.pos)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _placement(fd: int, offset: int, length: int, req, target: torch.Tensor) -> int | None:
    """File offset of the bytes ``target`` gets from this item, or ``None`` if they are not one run."""
    saved = torch.load(io.BufferedReader(_FileView(fd, offset, length)), map_location="meta", weights_only=True)
    if (not isinstance(saved, torch.Tensor) or target.device.type != "cpu" or saved.dtype != target.dtype
            or not saved.is_contiguous()
            or not target.is_contiguous() or saved.dim() == 0 and target.dim() != 0):
        return None
    starts, lengths = list(req.storage_offsets), list(req.lengths)
    if list(target.shape) != lengths or any(starts[1:]) or lengths[1:] != list(saved.shape[1:]):
        return None  # only whole rows: a run of bytes
    record = torch._C.PyTorchFileReader(io.BufferedReader(_FileView(fd, offset, length)))
    skip = saved.storage_offset() + (starts[0] * saved.stride(0) if saved.dim() else 0)
    return offset + record.get_record_offset("data/0") + skip * saved.element_size()


def _read_one(fd: int, offset: int, length: int, req, target: torch.Tensor) -> bool:
    at = _placement(fd, offset, length, req, target)
    if at is None:
        return False
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy()) if target.numel() else memoryview(b"")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], at + done)
        if n <= 0:
            raise OSError(f"short read: {done} of {len(view)} bytes at offset {at}")
        done += n
    return True


def read_into(path: str, items: list, planner, storage_data: dict) -> list:
    """Read the tensor items of one file into their targets; returns the requests left for DCP's path."""
    left, jobs = [], []
    fd = os.open(path, os.O_RDONLY)
    try:
        for req in items:
            info = storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                left.append(req)
                continue
            target = planner.resolve_tensor(req).detach()
            jobs.append((req, target, _pool.submit(_read_one, fd, info.offset, info.length, req, target)))
        for req, target, job in jobs:
            if job.result():
                planner.commit_tensor(req, target)
            else:
                left.append(req)
    finally:
        wait([job for _, _, job in jobs])  # after an error too: no read may outlive the fd (its number is reused)
        os.close(fd)
    return left
