"""nvrx_lab.checkpoint under faults: writer killed mid-save, disk full, file-size limit, a byte flipped mid-file
(a read-only folder, also as root: tests/test_reliability_checkpoint.py)."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess

import pytest
import torch

from nvrx_lab.checkpoint import (
    AsyncCheckpointer,
    CheckpointCorruptError,
    CheckpointWriteError,
    CheckpointWriterDied,
    committed_steps,
    step_dir,
)
from nvrx_lab.checkpoint.throttle import VERIFY_CHUNK
from nvrx_lab.net import wait_for


def state(mib: float, fill: float = 1.0) -> dict:
    return {"w": torch.full((int(mib * (1 << 20)) // 4,), fill), "step": int(fill)}


@pytest.mark.timeout(90)
def test_writer_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    sd = state(4)
    with AsyncCheckpointer(tmp_path, write_bandwidth=2 << 20) as ckpt:
        ckpt.config.write_bandwidth = None
        ckpt.async_save(sd, step=1)
        ckpt.finalize_async_save(blocking=True)
        ckpt.config.write_bandwidth = 1 << 20  # step 2 takes ~4 s: time to kill it half-way
        sd["w"].fill_(2.0)
        ckpt.async_save(sd, step=2)
        shard = lambda: next(iter(tmp_path.glob(".tmp_step_00000002_*/__0_0.distcp")), None)  # noqa: E731
        wait_for(lambda: shard() is not None and shard().stat().st_size > (1 << 20), timeout=30, what="half a shard")
        os.kill(ckpt.writer_pid, signal.SIGKILL)
        with pytest.raises(CheckpointWriterDied, match="step 2.*died") as e:
            ckpt.finalize_async_save(blocking=True)
        assert e.value.step == 2 and ".tmp_step_00000002_" in e.value.path
        assert ckpt.latest_step() == 1
        target = state(4, fill=0.0)
        ckpt.load(target)
        assert torch.equal(target["w"], torch.full_like(target["w"], 1.0)) and target["step"] == 1
        ckpt.config.write_bandwidth = None
        old_pid = ckpt.writer_pid
        ckpt.async_save(sd, step=3)  # a fresh writer takes over
        ckpt.finalize_async_save(blocking=True)
        assert ckpt.writer_pid != old_pid and ckpt.latest_step() == 3
    assert not list(tmp_path.glob(".tmp_*")), "stray temporary folders after the next successful save"


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.timeout(60)
def test_disk_full_surfaces_from_finalize_and_training_goes_on(tiny_tmpfs):
    root = tiny_tmpfs / "ckpt"
    with AsyncCheckpointer(root) as ckpt:
        ckpt.async_save(state(0.25), step=1)
        ckpt.finalize_async_save(blocking=True)
        ckpt.async_save(state(3, fill=2.0), step=2)  # does not fit in 2 MiB
        with pytest.raises(CheckpointWriteError, match=r"step 2.*No space left") as e:
            ckpt.finalize_async_save(blocking=True)
        assert e.value.step == 2 and str(tiny_tmpfs) in e.value.path
        assert ckpt.latest_step() == 1 and committed_steps(root) == [1]
        ckpt.async_save(state(0.25, fill=3.0), step=3)  # space is back (the failed save was removed)
        assert ckpt.finalize_async_save(blocking=True) == [3]
        target = state(0.25, fill=0.0)
        ckpt.load(target)
        assert target["step"] == 3


@pytest.mark.timeout(60)
def test_file_size_limit_error_names_step_and_file(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        ckpt = AsyncCheckpointer(tmp_path)  # the writer inherits the 1 MiB file-size limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with ckpt:
        ckpt.async_save(state(2), step=5)
        with pytest.raises(CheckpointWriteError, match=r"step 5: rank 0 could not write .*__0_0.distcp: File too large"):
            ckpt.finalize_async_save(blocking=True)
        assert ckpt.latest_step() is None
        ckpt.async_save(state(0.25), step=6)
        ckpt.finalize_async_save(blocking=True)
        assert ckpt.latest_step() == 6


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.timeout(60)
def test_a_corrupt_byte_mid_file_is_located_by_its_chunks_byte_range(tmp_path):
    """The checksums cover 16 MiB chunks: the error names the file and the bad chunk's bytes, not byte 0."""
    ckpt = AsyncCheckpointer(tmp_path, start_writer=False)
    ckpt.save(state(40), step=1)  # one shard of ~40 MiB: three chunks
    shard = step_dir(tmp_path, 1) / "__0_0.distcp"
    size = shard.stat().st_size
    assert size > 2 * VERIFY_CHUNK
    offset = VERIFY_CHUNK + (size - VERIFY_CHUNK) // 3  # mid-file, in the second chunk
    _flip(shard, offset)
    with pytest.raises(CheckpointCorruptError) as e:
        AsyncCheckpointer(tmp_path, start_writer=False).load(state(40, fill=0.0), step=1)
    message = str(e.value)
    assert str(shard) in message and e.value.path == str(shard), message
    where = re.search(r"CRC32C mismatch in bytes (\d+)-(\d+) of (\d+) \(chunk 2 of 3, (\d+) B each\)", message)
    assert where, message
    first, last, total, chunk = map(int, where.groups())
    assert first <= offset <= last and (first, last, total, chunk) == (VERIFY_CHUNK, 2 * VERIFY_CHUNK - 1, size, VERIFY_CHUNK)
    _flip(shard, size - 1)  # the last chunk too: the first bad one is named, the others counted
    with pytest.raises(CheckpointCorruptError, match=r"bytes \d+-\d+ of \d+ \(chunk 2 of 3, \d+ B each; 1 more bad chunk"):
        AsyncCheckpointer(tmp_path, start_writer=False).load(state(40, fill=0.0), step=1)
