"""The node's own resources: the checkpoint folder writable fast enough, free memory, free disk."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from nvrx_lab.health import Verdict, failed, ok

WRITE_BYTES = 1 << 20


def storage(folder: str, max_s: float = 5.0) -> Verdict:
    """A 1 MiB write + fsync + delete in ``folder`` (the checkpoints' file system) within ``max_s``."""
    path = Path(folder) / f".nvrx-health-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(os.urandom(WRITE_BYTES))
            f.flush()
            os.fsync(f.fileno())
        path.unlink()
    except OSError as exc:
        return failed("storage", f"{folder}: cannot write ({exc.strerror or exc})")
    took = time.monotonic() - t0
    if took > max_s:
        return failed("storage", f"{folder}: 1 MiB write+fsync took {took:.2f} s (> {max_s:g} s)")
    return ok("storage", f"{folder}: 1 MiB write+fsync {took * 1000:.0f} ms")


def memory(meminfo: str = "/proc/meminfo", min_gib: float = 4.0) -> Verdict:
    """``MemAvailable`` of ``meminfo`` at least ``min_gib``."""
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines() if ":" in line)
        avail = int(fields["MemAvailable"].split()[0]) / 2**20  # kB -> GiB
    except (OSError, KeyError, ValueError) as exc:
        return failed("memory", f"{meminfo}: no MemAvailable ({exc})")
    if avail < min_gib:
        return failed("memory", f"{avail:.1f} GiB available (< {min_gib:g} GiB)")
    return ok("memory", f"{avail:.1f} GiB available")


def disk(folder: str, min_gib: float = 1.0) -> Verdict:
    """Free space where ``folder`` lives."""
    try:
        free = shutil.disk_usage(folder).free / 2**30
    except OSError as exc:
        return failed("disk", f"{folder}: {exc.strerror or exc}")
    if free < min_gib:
        return failed("disk", f"{folder}: {free:.2f} GiB free (< {min_gib:g} GiB)")
    return ok("disk", f"{folder}: {free:.0f} GiB free")
