"""Checkpoint cases: kills mid-save, corrupted files, a full disk, a read-only folder
=====================================================================================

Five cases of the reliability suite (:mod:`nvrx_lab.reliability`) for :mod:`nvrx_lab.checkpoint`,
each on real files with real processes. The state saved at step ``s`` is a function of ``s``
(:func:`~.checkpoint_child.state_at`), so "loads" always means "loads exactly what step ``s`` saved".

* :func:`sigkill_trainer_mid_save` (in :mod:`.checkpoint_crash`, like the next one) — a trainer
  subprocess (:mod:`.checkpoint_child`) saves steps in a loop with a bandwidth cap (~0.5 s a save)
  and is SIGKILLed at a seeded random moment of its first, second or third save: staging, writing,
  commit, or just after. Half the trials kill its whole process group (trainer and writer at
  once), half the trainer alone — then its writer must exit on its own, unkilled (how long it took is
  the figure ``writer_outlived_s_max``). Afterwards
  a fresh checkpointer must find a latest step that loads exactly, at least as new as the last
  commit the trainer reported; every committed step must verify; no staging file may be left in
  ``/dev/shm``; and once the next save has committed, no temporary folder may be left. The next
  trial's trainer resumes from that save.
* :func:`sigkill_writer_mid_save` — the writer process of an in-process checkpointer is SIGKILLed
  held by the throttle's gate at a seeded point of its write: ``finalize_async_save`` raises
  :class:`~nvrx_lab.checkpoint.CheckpointWriterDied` naming the step, the previous step stays the
  latest and loads, the next save (a fresh writer) commits, no temporary folder is left.
* :func:`corruption` — one byte flipped in a shard, a truncated shard, the DCP ``.metadata`` of the
  newest checkpoint deleted: ``latest_step`` falls back to the previous step and logs why through the
  ``nvrx_lab`` logger (``nvrx_lab.checkpoint.checkpointer``); ``load`` of the bad step raises
  :class:`~nvrx_lab.checkpoint.CheckpointCorruptError` naming the file.
* :func:`disk_full` — a 4 MiB tmpfs filled by a ballast file (as root), or else a 1 MiB
  ``RLIMIT_FSIZE`` inherited by the writer: ``finalize_async_save`` raises a
  :class:`~nvrx_lab.checkpoint.CheckpointWriteError` naming the step and the path; the previous
  checkpoint is intact; once the space is back (ballast removed, or the writer's limit raised with
  ``prlimit``) the same save commits.
* :func:`permission_denied` — the folder turns read-only after a first commit, once before a save
  (the writer cannot create its temporary folder) and once while a save is written (the commit's
  rename is refused): a "Permission denied" naming the path, the previous checkpoint intact, and
  after ``chmod`` back the next save commits. Root ignores file modes, so as root the scenario runs
  in a subprocess started without ``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH`` and ``CAP_FOWNER``
  (dropped from the capability bounding set before ``exec``): still uid 0, so the interpreter, the
  venv and the work folder stay readable, but the kernel now checks the folder's mode bits.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

from nvrx_lab.checkpoint import AsyncCheckpointer, CheckpointCorruptError, CheckpointWriteError, committed_steps, step_dir
from nvrx_lab.reliability import Row, as_injected, logger_at, timed
from nvrx_lab.reliability.checkpoint_child import blank, fresh, holds_step, state_at, stray
from nvrx_lab.reliability.checkpoint_crash import sigkill_trainer_mid_save, sigkill_writer_mid_save

MIB = 1 << 20


# -------------------------------------------------------------------------- corruption
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


CORRUPTIONS = {  # name: (file in the newest checkpoint, damage, what the log and the error must say)
    "flipped byte": ("__0_0.distcp", _flip_byte, "CRC32C mismatch"),
    "truncated shard": ("__0_0.distcp", _truncate, "truncated"),
    "missing metadata": (".metadata", Path.unlink, "missing"),
}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _corrupt_once(folder: Path, file: str, damage, reason: str, mib: float) -> list[str]:
    """Save steps 1 and 2, damage ``file`` of step 2, look at it with a fresh checkpointer."""
    with AsyncCheckpointer(folder, start_writer=False) as ckpt:
        for step in (1, 2):
            ckpt.save(state_at(step, mib), step=step)
    bad, problems = step_dir(folder, 2) / file, []
    damage(bad)
    records = _Records()
    with logger_at("nvrx_lab", logging.WARNING, records):  # the checkpointer logs as nvrx_lab.checkpoint.*
        ckpt = AsyncCheckpointer(folder, start_writer=False)  # what a restarted trainer sees
        latest = ckpt.latest_step()
    if latest != 1:
        problems.append(f"latest_step() is {latest}, expected the fallback to 1")
    if not any("step 2 skipped" in line and str(bad) in line and reason in line for line in records.lines):
        problems.append(f"no log line saying step 2 was skipped because {bad} is {reason}: {records.lines}")
    try:
        ckpt.load(blank(mib), step=2)
        problems.append("load of step 2 raised nothing")
    except CheckpointCorruptError as e:
        if e.path != str(bad) or str(bad) not in str(e) or reason not in str(e):
            problems.append(f"the load error does not name {bad}: {e} (path {e.path})")
    state = blank(mib)
    if ckpt.load(state) != 1 or not holds_step(state, 1, mib):
        problems.append("step 1 does not load exactly")
    return problems


def corruption(work: Path, mib: float = 0.5) -> Row:
    """Damage the newest of two checkpoints three ways; the fallback, its log line and the load error."""
    row = Row("corrupted checkpoint", "detected; latest_step falls back to the previous step and logs why; "
              "load of the bad step names the file")
    with timed(row), as_injected(row):
        for name, (file, damage, reason) in CORRUPTIONS.items():
            try:
                problems = _corrupt_once(fresh(Path(work) / name.replace(" ", "_")), file, damage, reason, mib)
            except Exception as e:  # noqa: BLE001 - an unexpected error fails the trial, with its reason
                problems = [f"{type(e).__name__}: {e}"]
            row.check(not problems, f"{name}: " + "; ".join(problems))
    return row


# -------------------------------------------------------------------------- disk full
def _mount_tmpfs(mnt: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True).returncode == 0


def _fill(path: Path) -> None:
    """Write zeros into ``path`` until the file system is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(bytes(64 << 10))
                f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def _fill_up_once(ckpt: AsyncCheckpointer, take_space, give_space, said: str, mib: float) -> list[str]:
    """Commit a small step 1; ``take_space``; step 2 must fail clearly; ``give_space``; step 3 must commit."""
    folder, problems = ckpt.root, []
    ckpt.async_save(state_at(1, 0.25), step=1)
    ckpt.finalize_async_save(blocking=True)
    take_space()
    ckpt.async_save(state_at(2, mib), step=2)
    try:
        ckpt.finalize_async_save(blocking=True)
        problems.append("finalize_async_save raised nothing for a save that cannot fit")
    except CheckpointWriteError as e:
        if e.step != 2 or "step 2" not in str(e) or said not in str(e) or str(folder) not in str(e):
            problems.append(f"unclear error: {e} (path {e.path})")
    state = blank(0.25)
    if committed_steps(folder) != [1] or ckpt.load(state) != 1 or not holds_step(state, 1, 0.25):
        problems.append(f"previous checkpoint not intact: committed {committed_steps(folder)}")
    give_space()
    ckpt.async_save(state_at(3, mib), step=3)
    if ckpt.finalize_async_save(blocking=True) != [3]:
        problems.append("the same save did not commit once space was back")
    state = blank(mib)
    if ckpt.load(state) != 3 or not holds_step(state, 3, mib):
        problems.append("step 3 does not load exactly")
    if left := stray(folder):
        problems.append(f"stray entries after the next save: {left}")
    return problems


def disk_full(work: Path, mib: float = 1.0, tmpfs: bool | None = None) -> Row:
    """A save that does not fit: a clear error, the previous checkpoint intact, success once space is back.

    ``tmpfs``: None mounts a tmpfs if it can, else uses ``RLIMIT_FSIZE``; False always uses the limit."""
    row = Row("disk full", "finalize raises a clear error naming step and path; the previous checkpoint "
              "is intact; the same save commits once space is back")
    mnt = fresh(Path(work) / "disk")  # a 4 MiB tmpfs when it can be mounted
    with timed(row), as_injected(row):
        tmpfs = tmpfs is not False and _mount_tmpfs(mnt, "4m")
        row.figures["mode"] = "tmpfs" if tmpfs else "RLIMIT_FSIZE"
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        try:
            if not tmpfs:
                resource.setrlimit(resource.RLIMIT_FSIZE, (MIB, hard))  # inherited by the writer
            try:
                ckpt = AsyncCheckpointer(mnt / "ckpt", keep_last=3)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            with ckpt:
                if tmpfs:
                    problems = _fill_up_once(ckpt, lambda: _fill(mnt / "ballast"), (mnt / "ballast").unlink,
                                             "No space left", mib)
                else:
                    problems = _fill_up_once(ckpt, lambda: None, lambda: resource.prlimit(
                        ckpt.writer_pid, resource.RLIMIT_FSIZE, (soft, hard)), "File too large", mib)
        except Exception as e:  # noqa: BLE001 - a crash of the case is a failed trial, with its reason
            problems = [f"{type(e).__name__}: {e}"]
        finally:
            if tmpfs and subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        row.check(not problems, "; ".join(problems))
    return row


# -------------------------------------------------------------------------- read-only folder
_CAPS_ROOT_IGNORES_MODES = (1, 2, 3)
"""CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER (linux/capability.h)."""


def _without_mode_override():
    """A ``preexec_fn`` that drops from the bounding set the capabilities that let root ignore file modes,
    so the ``exec``-ed program (and the writer it spawns) runs as uid 0 without them."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not between fork and exec

    def drop() -> None:
        for cap in _CAPS_ROOT_IGNORES_MODES:
            if prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
    return drop


def permission_denied(work: Path, timeout: float = 120.0) -> Row:
    """The folder turns read-only mid-run (before a save, during one); see :mod:`.checkpoint_child`."""
    row = Row("read-only folder", "finalize raises Permission denied naming the path; the previous checkpoint "
              "is intact; after chmod back the next save commits")
    folder = fresh(Path(work) / "ckpt")
    cmd = [sys.executable, "-m", "nvrx_lab.reliability.checkpoint_child", "readonly", str(folder)]
    with timed(row), as_injected(row):
        as_root = os.geteuid() == 0
        row.figures["ran_as"] = "uid 0 without CAP_DAC_OVERRIDE" if as_root else f"uid {os.geteuid()}"
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 preexec_fn=_without_mode_override() if as_root else None)
            text = out.stdout + out.stderr
        except (subprocess.SubprocessError, OSError) as e:
            text = f"{type(e).__name__}: {e}"
        finally:
            if folder.exists():
                folder.chmod(0o755)
        results = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        for r in results:
            row.check(r["ok"], r["why"])
        for missing in range(len(results), 2):
            row.check(False, f"trial {missing} did not report: {text[-1500:]}")
    return row


__all__ = ["sigkill_trainer_mid_save", "sigkill_writer_mid_save", "corruption", "disk_full", "permission_denied"]
