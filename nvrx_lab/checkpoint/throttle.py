"""Storage simulation: cap the write bandwidth of one writer (bytes/s).

This box writes to a page cache at several GB/s; a shared filesystem under load (FSx for Lustre at
checkpoint time on p5) gives each rank far less. :class:`Throttle` makes a writer sleep so that its
bytes never run ahead of ``bandwidth``, which reproduces the regime where the write is as long as the
checkpoint interval's compute. :class:`MeteredStream` wraps a binary file: every byte written goes
through the throttle and into running CRC32Cs (:mod:`.checksum`; one per 16 MiB of file, so verification can use every
core), so the shard's checksums cost no second read.

A capped stream also has a gate, for tests and notebook 01: while a file :data:`HOLD_NAME` exists in the folder
above the one written into (a checkpoint's root, for a shard in its temporary folder), the stream stops (flushed)
after the chunk that takes it to the byte count the file holds (empty: 0), and goes on once the file is removed:
a kill lands mid-write by construction, however busy the machine is.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from nvrx_lab.net import wait_for

from .checksum import KEY, crc32c

CHUNK = 1 << 20
"""Bytes written per ``write`` call, so a throttled write (and a kill) happens mid-file."""
VERIFY_CHUNK = 16 << 20
"""A CRC32C per 16 MiB of file, so verification runs on all cores in parallel."""
HOLD_NAME = ".write_hold"
"""The gate's file (see the module docstring); no such file, no gate."""
HOLD_S = 600.0
"""A hang guard: a write held longer (a harness that never removed the file) fails with ``TimeoutError``."""


def check_bandwidth(value: float | None, name: str = "write_bandwidth") -> float | None:
    """The one rule for a write bandwidth cap: ``None`` or ``0`` is no cap (returns ``None``), a number
    ``> 0`` is a cap in bytes/s (returned as a float); anything else raises ``ValueError`` naming ``name``.

    ``AsyncCheckpointer(write_bandwidth=...)``, :class:`Throttle` and the trainer's
    ``--ckpt-write-bandwidth`` (0 by default) all go through it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number of bytes/s > 0, or 0 (or None) for no cap; got {value!r}")
    return float(value) if value else None


@dataclass
class Throttle:
    """Token-bucket style cap: ``wait(n)`` sleeps until ``n`` more bytes fit under ``bandwidth``.

    Storage does not bank bandwidth a writer left unused: the clock starts at the first ``wait`` after
    :meth:`reset`, and a writer that fell behind (planning, a loaded CPU) gets at most one
    :data:`CHUNK` of credit, so it never bursts through the rest of a file at page-cache speed."""

    bandwidth: float | None = None
    """Bytes per second; ``None`` or ``0`` means unlimited (:func:`check_bandwidth`)."""
    _start: float | None = field(default=None, repr=False)
    _sent: int = field(default=0, repr=False)

    def __post_init__(self):
        self.bandwidth = check_bandwidth(self.bandwidth)
        self.reset()

    def reset(self) -> None:
        self._start = None
        self._sent = 0

    def wait(self, nbytes: int) -> None:
        self._sent += nbytes
        if not self.bandwidth:
            return
        if self._start is None:
            self._start = time.monotonic()
        due = self._start + self._sent / self.bandwidth
        delay = due - time.monotonic()
        if delay < -CHUNK / self.bandwidth:
            self._start -= delay  # behind by more than a chunk: this one goes free, the rest pays again
        elif delay > 0:
            time.sleep(delay)


class MeteredStream:
    """A write-only binary stream over ``raw`` that throttles, counts and checksums what passes."""

    def __init__(self, raw, throttle: Throttle):
        self.raw = raw
        self.throttle = throttle
        self.chunks: list[int] = []
        self._crc, self._fill = 0, 0
        self.size = 0
        self.error: OSError | None = None
        name = getattr(raw, "name", None)  # the file's path (an fd or nothing: no gate)
        self._hold = Path(name).parent.parent / HOLD_NAME \
            if throttle.bandwidth and isinstance(name, (str, os.PathLike)) else None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CHUNK):
            chunk = view[start:start + CHUNK]
            try:
                self.raw.write(chunk)
            except OSError as e:  # torch.save's zip writer would hide it behind "unexpected pos"
                self.error = e
                raise
            self._checksum(chunk)
            self.throttle.wait(len(chunk))
            if self._hold is not None:
                self._held(self._hold, self.size + start + len(chunk))
        self.size += len(view)
        return len(view)

    def _held(self, hold: Path, written: int) -> None:
        """The gate: while the file ``hold`` is there and ``written`` reached its byte count, wait (flushed)."""
        def released() -> bool:
            try:
                return written < int(hold.read_text() or 0)
            except FileNotFoundError:
                return True

        if not released():
            self.raw.flush()
            wait_for(released, HOLD_S, f"{self._hold} to be removed", interval=0.005)

    def _checksum(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            part = data[pos:pos + VERIFY_CHUNK - self._fill]
            self._crc = crc32c(part, self._crc)
            self._fill += len(part)
            pos += len(part)
            if self._fill == VERIFY_CHUNK:
                self.chunks.append(self._crc)
                self._crc, self._fill = 0, 0

    def entry(self) -> dict:
        """``{"size", "chunk_bytes", "crc32c_chunks"}`` of everything written so far."""
        tail = [self._crc] if self._fill else []
        return {"size": self.size, "chunk_bytes": VERIFY_CHUNK, KEY: self.chunks + tail}

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed
