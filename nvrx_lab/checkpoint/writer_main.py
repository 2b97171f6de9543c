"""The writer process's own side: its main loop, and how the trainer starts it.

A writer starts in one of two ways (:func:`can_fork` decides, :class:`~.writer.WriterProcess` asks):

* **forked** from the trainer (:class:`ForkedWriter`): torch is imported already, so it is ready in
  milliseconds. Only while no CUDA context exists in the trainer (a forked child must not inherit one):
  on CPU always, on GPUs when the checkpointer is made before CUDA is first used;
* a **clean interpreter** (:func:`command`): ``python -c "…writer_main(…)"`` imports this module and torch
  (~2 s). Never a ``multiprocessing`` ``spawn`` child, which re-imports the trainer's ``__main__`` and so
  runs a script without an ``if __name__ == "__main__":`` guard all over again.

Either way :func:`writer_main` runs: it lowers its own priority (:mod:`.priority`), says ``ready``, then
serves one request at a time until its trainer closes the socket or dies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from nvrx_lab.net import wait_for

from .priority import WriterPriority


def _serve(msg: dict, regions: dict) -> dict:
    from .shards import write_shards
    from .staging import open_region, slot_view

    step, tmp, rank = msg["step"], Path(msg["tmp"]), msg["rank"]
    if msg["region"] not in regions:
        for old in list(regions):
            regions.pop(old).close()
        regions[msg["region"]] = open_region(msg["region"])
        try:  # the trainer unlinks it too once this save is collected: too late if it is killed before
            os.unlink(msg["region"])
        except OSError:  # gone already, or not ours to remove: the trainer's unlink stays the fallback
            pass
    mm = regions[msg["region"]]
    data = {item.index: slot_view(mm, slot) for item, slot in zip(msg["tensor_items"], msg["slots"], strict=True)}
    data.update(msg["byte_items"])
    try:
        results, files, write_s = write_shards(tmp, rank, msg["plan"], data, msg["bandwidth"], step)
    finally:
        data.clear()
    return {"bytes": sum(f["size"] for f in files.values()), "write_s": write_s, "files": files, "results": results}


def _exit_with_trainer(death_fd: int) -> None:
    """Watch thread: the pipe reads EOF once the trainer is gone; exit at once, even mid-write."""
    while os.read(death_fd, 1):
        pass
    os._exit(1)


def writer_main(conn_fd: int, death_fd: int, **priority) -> None:
    """The writer process: lower its priority (:class:`~.priority.WriterPriority` ``**priority``), then
    serve requests until ``None`` or the trainer's death."""
    not_applied = WriterPriority(**priority).apply()
    threading.Thread(target=_exit_with_trainer, args=(death_fd,), daemon=True, name="nvrx-ckpt-trainer-watch").start()
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer decides
    conn = Connection(conn_fd)
    from . import shards  # noqa: F401 - imports torch: the slow part of the start-up

    regions: dict = {}
    conn.send(("ready", None, {"pid": os.getpid(), "not_applied": not_applied}))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        try:
            conn.send(("done", msg["step"], _serve(msg, regions)))
        except Exception as e:  # noqa: BLE001 - reported to the trainer, the writer lives on
            info = {"step": msg["step"], "rank": msg["rank"], "path": getattr(e, "path", None) or msg["tmp"],
                    "errno": getattr(e, "errno", None), "error": f"{type(e).__name__}: {e}"}
            conn.send(("error", msg["step"], info))
    for mm in regions.values():
        mm.close()


PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
"""Where this copy of ``nvrx_lab`` lives: the clean interpreter imports the same one (an uninstalled checkout too)."""


def command(conn_fd: int, death_fd: int, priority: WriterPriority) -> list[str]:
    """A clean interpreter running :func:`writer_main` (never the trainer's ``__main__``)."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {PACKAGE_PARENT!r}); "
            "from nvrx_lab.checkpoint.writer_main import writer_main; "
            f"writer_main({conn_fd}, {death_fd}, {priority.as_args()})"]


def can_fork() -> bool:
    """Whether a writer may be forked from this process: never once CUDA is initialised here (a forked
    child must not inherit a CUDA context), nor where ``fork`` does not exist."""
    if not hasattr(os, "fork"):
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


class ForkedWriter:
    """The writer forked from the trainer: it starts in milliseconds (torch is imported already), where a
    new interpreter takes ~2 s. The child keeps only its socket, the death pipe and stdio, resets the
    signals the trainer's layers handle, never returns into the trainer's code and exits with
    ``os._exit`` (no atexit handler, no finaliser of the trainer's objects runs in it). It runs nothing
    of the user's script: a fork copies the process, it does not re-run ``__main__``. The same
    :class:`subprocess.Popen` surface as a spawned writer (``pid``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, conn_fd: int, death_fd: int, log_fd: int, priority: WriterPriority):
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:  # the writer
            code = 1
            try:
                _become_writer(conn_fd, death_fd, log_fd)
                writer_main(conn_fd, death_fd, **dataclasses.asdict(priority))
                code = 0
            except BaseException:  # noqa: BLE001 - the last line of the log is why() the writer died
                traceback.print_exc()
            finally:
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (SIGCHLD ignored): gone, its status unknown
                pid, status = self.pid, None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status) if status is not None else -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            wait_for(lambda: self.poll() is not None, float("inf") if timeout is None else timeout,
                     f"writer {self.pid} to exit", interval=0.01)
        except TimeoutError:
            raise subprocess.TimeoutExpired(f"writer {self.pid}", timeout) from None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _become_writer(conn_fd: int, death_fd: int, log_fd: int) -> None:
    """In the forked child: stdio to the writer's log, every other inherited descriptor closed (the
    trainer's sockets, its store connections, another writer's death pipe), default signal handlers."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    keep = {0, 1, 2, conn_fd, death_fd}
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # the trainer's buffered output stays the trainer's
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    logging.root.handlers = [logging.StreamHandler(sys.stderr)]  # the trainer's handlers write to closed fds


