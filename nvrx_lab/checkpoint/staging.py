"""Staging: a consistent snapshot of the state in memory that a writer process can read.

``async_save`` must return quickly *and* leave a checkpoint that holds the values of the moment of
the call, whatever training does to the tensors afterwards. Handing tensors to a
``multiprocessing`` queue does not give that: torch's reductions move a CPU tensor's storage into
shared memory and send a handle, so the writer would read the live, mutating tensor. We therefore
copy, explicitly, into a :class:`StagingBuffer`:

* one memory-backed file per rank (``/dev/shm``), ``mmap``-ed by the trainer and by its writer
  process, allocated once and reused by every save (it only grows when the state does);
* on a GPU machine the same pages are registered with ``cudaHostRegister`` (pinned), the device
  tensors are copied with ``non_blocking=True`` and one stream sync ends the staging;
* each tensor gets a 64-byte aligned slot; the :class:`Slot` list (offset, size, dtype, shape) is all
  the writer needs to rebuild exact-size tensors over the same pages, without a copy.

Tied tensors (one tensor under two keys) are staged once per key, at the same instant, so both keys
hold the same values. Non-contiguous views are copied into contiguous slots (``copy_`` handles any
stride); bf16, integer and bool tensors keep their dtype. Non-tensor values never come here: the
planner serialises them to bytes at staging time (see :mod:`.planning`).

The region's file is unlinked as soon as the writer has mapped it (after its first response), so a
killed trainer leaves nothing behind in ``/dev/shm``; a replacement writer gets a fresh region.

Because a slot is reused, a new save must wait until the writer has finished reading the previous
one — the "a save waits" policy of :class:`~nvrx_lab.checkpoint.AsyncCheckpointer`.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import uuid
from dataclasses import dataclass

import torch

ALIGN = 64
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """Where one staged tensor lives in the buffer."""

    offset: int
    """Byte offset in the buffer (a multiple of 64)."""
    numel: int
    """Number of elements."""
    dtype: str
    """``str(torch.dtype)``, e.g. ``"torch.bfloat16"``."""
    shape: tuple[int, ...]
    """Shape of the staged (contiguous) tensor."""

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype(self.dtype).itemsize


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in staging layout")
    return dt


def plan_slots(tensors: list[torch.Tensor]) -> tuple[list[Slot], int]:
    """Aligned slots for ``tensors`` and the total bytes they need."""
    slots, offset = [], 0
    for t in tensors:
        slots.append(Slot(offset, t.numel(), str(t.dtype), tuple(t.shape)))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return slots, offset


def slot_view(buf: mmap.mmap, slot: Slot) -> torch.Tensor:
    """A tensor whose storage is exactly ``slot`` inside ``buf`` (no copy)."""
    dtype = _dtype(slot.dtype)
    if slot.numel == 0:
        return torch.empty(slot.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=slot.numel, offset=slot.offset).view(slot.shape)


def sweep_dead_regions(folder: str) -> list[str]:
    """Remove regions left by processes that are gone (``nvrx_ckpt_<pid>_…``, a trainer SIGKILLed between
    creating its region and its writer mapping it); a region whose pid is alive is never touched."""
    removed = []
    for name in os.listdir(folder):
        parts = name.split("_")
        if len(parts) < 4 or parts[:2] != ["nvrx", "ckpt"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))
                removed.append(name)
        except PermissionError:  # alive, someone else's
            pass
    return removed


_swept = False


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class StagingBuffer:
    """A reusable shared-memory region; :meth:`stage` copies tensors in and returns their slots."""

    def __init__(self, tag: str = "", pin: bool | None = None, path: str | None = None):
        self.tag = tag
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.fixed = path
        """A named region that outlives this process (local checkpoints): never unlinked but by :meth:`unlink`."""
        self.path: str | None = None
        self.capacity = 0
        self._mm: mmap.mmap | None = None
        self._pinned_ptr: int | None = None
        self._unlinked = False
        self._views: dict[Slot, torch.Tensor] = {}  # of the current region: a save every step builds none

    def ensure(self, nbytes: int) -> bool:
        """Make room for ``nbytes``; return True when a new region (new ``path``) was created."""
        if self._mm is not None and nbytes <= self.capacity:
            return False
        self.release()
        self.capacity = max(nbytes, ALIGN)
        global _swept
        if not self.fixed and not _swept:  # once a process: what killed trainers left in this folder
            sweep_dead_regions(shm_dir())
            _swept = True
        self.path = self.fixed or os.path.join(shm_dir(), f"nvrx_ckpt_{os.getpid()}_{self.tag}_{uuid.uuid4().hex[:8]}")
        self._unlinked = False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if self.fixed else os.O_EXCL), 0o600)
        try:
            os.ftruncate(fd, self.capacity)
            self._mm = mmap.mmap(fd, self.capacity)
        finally:
            os.close(fd)
        if self.pin:
            whole = torch.frombuffer(self._mm, dtype=torch.uint8)
            ptr = whole.data_ptr()
            del whole
            rc = int(torch.cuda.cudart().cudaHostRegister(ptr, self.capacity, 1))  # cudaHostRegisterPortable
            if rc == 0:
                self._pinned_ptr = ptr
            else:  # still correct, only slower: device-to-host copies become synchronous
                log.warning("cudaHostRegister of %d B staging memory failed (cudaError %d); staging unpinned",
                            self.capacity, rc)
        return True

    def prefault(self) -> None:
        """Touch every page now (tmpfs allocates on first write): the first save then copies at the
        speed of the later ones instead of paying ~65k page faults per 256 MiB."""
        if self._mm is not None:
            whole = torch.frombuffer(self._mm, dtype=torch.uint8)
            whole.zero_()
            del whole

    @property
    def region(self) -> mmap.mmap | None:
        return self._mm

    def stage(self, tensors: list[torch.Tensor], reserve: int = 0,
              planned: tuple[list[Slot], int] | None = None) -> list[Slot]:
        """Copy ``tensors`` (any device, stride, dtype) into the buffer, leaving ``reserve`` bytes free after
        them; returns once the copies are done. ``planned``: their :func:`plan_slots`, if known already."""
        slots, total = planned or plan_slots(tensors)
        self.ensure(total + reserve)
        mm = self._mm
        if mm is None:  # ensure() maps a region or raises
            raise RuntimeError(f"staging buffer {self.tag!r}: no region mapped after ensure({total + reserve})")
        any_cuda = False
        for t, slot in zip(tensors, slots, strict=True):
            if slot.numel == 0:
                continue
            dst = self._views.get(slot)
            if dst is None:
                dst = self._views[slot] = slot_view(mm, slot)
            src = t.detach()
            if src.is_cuda:
                any_cuda = True
                dst.copy_(src, non_blocking=self._pinned_ptr is not None)
            else:
                dst.copy_(src)
        if any_cuda:
            torch.cuda.current_stream().synchronize()
        return slots

    def unlink(self) -> None:
        """Remove the region's name once the writer has mapped it: both mappings stay valid, and
        nothing is left in ``/dev/shm`` if this process is killed. A new writer needs a new region."""
        if self.path and not self._unlinked:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._unlinked = True

    def release(self) -> None:
        """Unmap and delete the region (views handed out earlier must be gone)."""
        self._views.clear()
        if self._pinned_ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            finally:
                self._pinned_ptr = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the OS frees it at exit
                pass
            self._mm = None
        if self.fixed:  # the file stays for the next process (or the peer): only unlink() removes it
            self._unlinked = True
        self.unlink()
        self.path, self._unlinked = None, False
        self.capacity = 0

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


def open_region(path: str) -> mmap.mmap:
    """The writer's side: map the region created by :meth:`StagingBuffer.ensure`."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
