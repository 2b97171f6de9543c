"""The node's janitor: removes a run's local-checkpoint folder once no process of the run has held it
for a grace period, so ``/dev/shm`` is clean even after every process of the job was SIGKILLed.

Local snapshots (:mod:`.local`) must outlive their process: a worker the launcher replaces restores
from them. So no process can remove them on its way out; a clean exit does, a killed job cannot. Every
process using the folder holds a shared ``flock`` on ``<dir>/.alive`` for as long as it lives (the
kernel drops it when the process dies, however it dies). This janitor, started once per folder in a
session of its own (a job's process-group SIGKILL does not reach it), polls with a non-blocking
exclusive lock, one ``flock`` per poll: when it has found the folder unheld for ``grace`` seconds in a
row, it removes it, holding the lock so a newcomer waits, and exits. A replacement worker that takes
the lock within the grace period keeps the folder. It exits at once when the folder is gone (a clean
exit removed it).

The users' side: :func:`hold` (take the folder's lock) and :func:`start` (one janitor per folder), called
by :class:`~.local.LocalCheckpointer`. :func:`start` runs this file as a plain script: never the checkpoint package (and
torch), only the standard library and :func:`nvrx_lab.net.wait_for` (standard library itself)::

    python -I janitor.py DIR GRACE_S
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time

ALIVE = ".alive"
POLL_S = 0.5


def unheld(path: str) -> bool:
    """Nobody holds ``path``'s lock (one non-blocking attempt, released at once)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # drops the lock too


def remove_if_unheld(folder: str) -> bool:
    """Remove ``folder`` while holding its lock exclusively; False when someone holds it."""
    try:
        fd = os.open(os.path.join(folder, ALIVE), os.O_RDONLY)
    except FileNotFoundError:
        shutil.rmtree(folder, ignore_errors=True)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def hold(folder: str) -> int:
    """Create ``folder`` if needed and hold its lock, shared; returns the fd (closing it lets go)."""
    alive = os.path.join(folder, ALIVE)
    while True:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(alive, os.O_RDONLY | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.fstat(fd).st_ino == os.stat(alive).st_ino:
                return fd  # not removed by the janitor while we waited for the lock
        except FileNotFoundError:
            pass
        os.close(fd)


def start(folder: str, grace_s: float) -> None:
    """Start the folder's janitor unless one runs (one per folder: ``janitor.pid`` is created exclusively)."""
    pid_file = os.path.join(folder, "janitor.pid")
    for _ in range(2):
        try:
            fd = os.open(pid_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            try:
                with open(pid_file) as f:
                    os.kill(int(f.read()), 0)
                return
            except ValueError:  # another process is starting it right now
                return
            except (ProcessLookupError, FileNotFoundError):  # a janitor that died: start another
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(pid_file)
                continue
        proc = subprocess.Popen([sys.executable, "-I", __file__, folder, str(grace_s)], start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.write(fd, str(proc.pid).encode())
        os.close(fd)
        return


def main(folder: str, grace_s: float) -> int:
    """Wait, without a deadline, until ``folder`` is gone or has been unheld for ``grace_s`` s in a row (then remove it)."""
    from nvrx_lab.net import wait_for  # stdlib only: the checkpoint package (and torch) is never imported here

    alive = os.path.join(folder, ALIVE)
    free_since: float | None = None

    def finished() -> bool:
        nonlocal free_since
        if not os.path.isdir(folder):
            return True
        if not unheld(alive):
            free_since = None
        elif free_since is None:
            free_since = time.monotonic()
        elif time.monotonic() - free_since >= grace_s and remove_if_unheld(folder):
            return True
        return False

    wait_for(finished, float("inf"), f"{folder} unheld for {grace_s} s", interval=POLL_S)
    return 0


if __name__ == "__main__":  # a plain script (python -I): the package's parent on the path, for nvrx_lab.net alone
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
