"""The one bounded way to run a process group (:func:`run`), re-exported by :mod:`nvrx_lab.runner`."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int
    output: str
    """stdout and stderr, interleaved (the log file's text when run with ``log=``)."""
    wall_s: float
    timed_out: bool = False

    def check(self) -> RunResult:
        if self.returncode != 0:
            raise RuntimeError(f"exit code {self.returncode}: {' '.join(self.cmd)}\n{self.output[-3000:]}")
        return self


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


LINGER_S = 5.0
"""How long output may stay open after the job's leader exited before whatever holds it is killed and named."""


def run(cmd: Sequence[str], timeout: float = 300, env: dict | None = None, cwd: str | os.PathLike | None = None,
        log: str | os.PathLike | None = None, kill_leftovers: bool = True) -> RunResult:
    """Run ``cmd`` in a new session with ``OMP_NUM_THREADS=1`` and ``env`` over this environment; output
    captured, or written to the file ``log``. On timeout the whole process group is killed and the result
    says so; after the leader exits, whatever is left of its group (a hung rank, a writer) is killed too,
    unless ``kill_leftovers`` is false (a caller that counts what a job leaves behind). ``wall_s`` ends when the
    leader exits; a process of the group that still holds the output :data:`LINGER_S` later is named in the
    output and killed (it would otherwise hold a pipe, and whoever reads it, until it exits by itself)."""
    cmd = [str(c) for c in cmd]
    t0 = time.perf_counter()
    timed_out, note, chunks = False, "", []
    sink = open(log, "w") if log is not None else None
    try:
        proc = subprocess.Popen(cmd, stdout=sink or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, cwd=cwd,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        pipe = proc.stdout  # None when written to ``log``
        reader = None if pipe is None else threading.Thread(target=lambda: chunks.append(pipe.read()), daemon=True)
        if reader is not None:
            reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            proc.wait()
            timed_out = True
        wall = time.perf_counter() - t0
        if reader is not None:
            reader.join(LINGER_S if kill_leftovers or timed_out else None)
            if reader.is_alive():
                note = (f"\n[nvrx_lab.runner] the job exited, but {held_by(proc.pid)} still held its output "
                        f"{LINGER_S:.0f} s later: killed")
        if kill_leftovers or timed_out:
            _killpg(proc.pid)
        if reader is not None:
            reader.join()
        if pipe is not None:
            pipe.close()
    finally:
        if sink is not None:
            sink.close()
    out = Path(log).read_text(errors="replace") if log is not None else "".join(chunks) + note
    if timed_out:
        out += f"\n[nvrx_lab.runner] killed after {timeout} s"
    return RunResult(cmd, proc.returncode, out, wall, timed_out)


def held_by(group: int) -> str:
    """The live processes of process group ``group``, as ``pid 12 (python -m ...)``, for a line."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getpgid(p.pid) == group and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"pid {p.pid} ({' '.join(p.info['cmdline'] or [])[:120]})")
        except (ProcessLookupError, psutil.Error):
            continue
    return ", ".join(found) or "a process of the job"


