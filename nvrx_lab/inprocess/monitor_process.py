"""The monitor process: one per rank, the part that survives the rank
====================================================================

A thread cannot rescue a process that is frozen in native code or killed, so each rank starts a
small child process (forked at start, so it needs no second ``import torch``) that:

* **hard timeout** — reads the rank's last progress time from shared memory (``memfd``, written
  by ``ping`` and by the wrapper's own phases); if none for ``hard_timeout`` while armed, it
  SIGKILLs the rank, then reports it dead so the others continue without it;
* **death notice** — polls ``getppid()``; when the rank is gone (SIGKILL, OOM kill) without
  having finished, it writes ``dead/<rank>`` and a fault report for the current attempt, so peers
  learn in tens of milliseconds instead of waiting out the heartbeat timeout;
* **store host** — on rank 0 it also hosts the wrapper's ``TCPStore``, and keeps hosting after
  rank 0 dies, until every rank has left or is known dead, or nobody beat for ``idle_exit`` s.

* **heartbeat** — adds to ``hb/<rank>`` every ``heartbeat_interval`` while the rank lives (so does
  the rank's monitor thread): a rank that holds its GIL for a while (a long native call, a
  TCPStore connect stuck in DNS) is not mistaken for dead; frozen ranks are the hard timeout's job.
  If the rank *and* its monitor process die together (a lost node), the beats stop and peers
  notice after ``heartbeat_timeout``.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import time

from nvrx_lab.net import wait_for

_LAYOUT = struct.Struct("<dqqq")  # last_progress (monotonic s), iteration, armed, finished


class Progress:
    """The shared page between a rank and its monitor process (both sides use this class)."""

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd = os.memfd_create("nvrx_lab_progress", 0)
            os.ftruncate(fd, mmap.PAGESIZE)
        self.fd = fd
        self.map = mmap.mmap(fd, mmap.PAGESIZE)

    def write(self, *, progress: float | None = None, iteration: int | None = None,
              armed: bool | None = None, finished: bool | None = None) -> None:
        p, it, a, f = _LAYOUT.unpack_from(self.map, 0)
        _LAYOUT.pack_into(self.map, 0, time.monotonic() if progress is None else progress,
                          it if iteration is None else iteration,
                          a if armed is None else int(armed), f if finished is None else int(finished))

    def read(self) -> tuple[float, int, bool, bool]:
        p, it, a, f = _LAYOUT.unpack_from(self.map, 0)
        return p, it, bool(a), bool(f)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class MonitorProcess:
    """Handle on the forked monitor process (``pid``; ``wait``/``kill`` like ``Popen``)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        wait_for(lambda: self.poll() is not None, timeout, f"monitor process {self.pid} to exit", interval=0.005)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(rank: int, world_size: int, store_host: str, store_port: int, host_store: bool,
          hard_timeout: float, interval: float = 0.02, heartbeat_interval: float = 0.5,
          idle_exit: float = 30.0) -> tuple[MonitorProcess, Progress]:
    """Fork the monitor process of this rank; returns its handle and the shared progress page.

    Forked, not exec'd: it starts in milliseconds with torch already imported (a fresh
    interpreter pays ``import torch`` again, seconds on a busy host). Call this before any
    thread or process group exists. The child closes every inherited descriptor but the
    progress page, so a dead rank's sockets really close, and leaves with ``os._exit``.
    """
    progress = Progress()
    progress.write(progress=time.monotonic(), iteration=0, armed=False, finished=False)
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return MonitorProcess(pid), progress
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the rank; we follow its fate
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        keep = {0, 1, 2, progress.fd}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        code = _run(rank, world_size, store_host, store_port, host_store, hard_timeout, interval,
                    heartbeat_interval, idle_exit, progress, parent)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run(rank, world_size, store_host, store_port, host_store, hard_timeout, interval, heartbeat_interval,
         idle_exit, progress: Progress, parent_pid: int) -> int:
    from . import store as st

    server = st.host(store_port, bind=store_host) if host_store else None
    client = st.RestartStore(st.connect(store_host, store_port))
    parent_gone = False
    next_beat = 0.0
    while not parent_gone:
        time.sleep(interval)
        last, iteration, armed, finished = progress.read()
        if time.monotonic() >= next_beat and os.getppid() == parent_pid:
            client.beat(rank)
            next_beat = time.monotonic() + heartbeat_interval
        if os.getppid() != parent_pid:
            parent_gone = True
            if not finished:
                _report_dead(client, rank, iteration, "dead", "process exited without finishing (killed?)")
        elif armed and time.monotonic() - last > hard_timeout:
            os.kill(parent_pid, signal.SIGKILL)
            parent_gone = True
            _report_dead(client, rank, iteration, "hard_timeout",
                         f"no progress for {time.monotonic() - last:.1f} s > hard_timeout {hard_timeout} s; killed")
        elif finished:
            parent_gone = True
    client.leave(rank)
    if server is not None:  # keep the store up for the others
        _serve_until_idle(client, world_size, idle_exit)
    return 0


def _report_dead(client, rank: int, iteration: int, cause: str, detail: str) -> None:
    t = time.time()
    # the report first: a survivor that sees the death may attribute the restart at once
    client.report_fault(iteration, rank, cause, detail, t)
    client.announce_death(rank, cause, detail, t)


def _serve_until_idle(client, world_size: int, idle_exit: float) -> None:
    last_beats, last_change = None, time.monotonic()
    while True:
        if client.all_gone(world_size):
            time.sleep(0.5)  # let the last clients finish their calls
            return
        beats = client.heartbeats(range(world_size))
        if beats != last_beats:
            last_beats, last_change = beats, time.monotonic()
        elif time.monotonic() - last_change > idle_exit:
            return
        time.sleep(0.1)

