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
  rank 0 dies, until every rank has left or is known dead, or nobody beat for ``idle_exit`` s;
* **heartbeat judge** — rank 0's (the store host's) reads every rank's counter in one ``multi_get`` per
  ``heartbeat_interval`` (the only reader of heartbeats: O(N) operations a second in all, not a
  loop over every rank in every rank) and declares a rank whose counter stood still for
  ``heartbeat_timeout`` dead: a death notice and a fault report for the current attempt.

A death notice may be what a rendezvous still waits for (the dead cannot arrive): whoever writes
one also tries to decide the open rendezvous (:func:`.rendezvous.help_decide`), with the rank
assignment policy the process inherited from the rank.

* **heartbeat** — adds to ``hb/<rank>`` every ``heartbeat_interval`` while the rank lives, and notes
  the time in the shared page (the rank's monitor thread beats only when these notes stop, so a
  rank looks dead only when both have stopped, and the store gets one beat a rank): a rank that
  holds its GIL for a while (a long native call, a TCPStore connect stuck in DNS) is not mistaken
  for dead; frozen ranks are the hard timeout's job.
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

from .rank_assignment import ShiftRanks

_FIELDS = {"progress": (0, "<d"), "iteration": (8, "<q"), "armed": (16, "<q"), "finished": (24, "<q"),
           "store_up": (32, "<q"), "beat": (40, "<d")}
"""Offset and format of each field of the shared page, one aligned 8-byte word each."""


class Progress:
    """The shared page between a rank and its monitor process (both sides use this class).

    The monitor reads while the rank writes, from another process, so no read may see half a write.
    ``struct.pack_into`` zero-fills its target before packing into it: a read in between saw
    ``progress == 0`` with ``armed`` set, and the monitor killed a healthy rank for "no progress for
    36,000 s" (the box's uptime). So every field is one aligned 8-byte word, written by a single copy
    of packed bytes; the rank writes ``progress`` before ``armed``, and the monitor reads ``armed``
    before ``progress`` (stores and loads keep their order on x86-64), so an armed page never comes
    with a progress time older than the arming."""

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd = os.memfd_create("nvrx_lab_progress", 0)
            os.ftruncate(fd, mmap.PAGESIZE)
        self.fd = fd
        self.map = mmap.mmap(fd, mmap.PAGESIZE)

    def _put(self, name: str, value) -> None:
        offset, fmt = _FIELDS[name]
        self.map[offset:offset + 8] = struct.pack(fmt, value)

    def _get(self, name: str):
        offset, fmt = _FIELDS[name]
        return struct.unpack(fmt, self.map[offset:offset + 8])[0]

    def write(self, *, progress: float | None = None, iteration: int | None = None,
              armed: bool | None = None, finished: bool | None = None) -> None:
        self._put("progress", time.monotonic() if progress is None else progress)
        for name, value in (("iteration", iteration), ("armed", armed), ("finished", finished)):
            if value is not None:
                self._put(name, int(value))

    def read(self) -> tuple[float, int, bool, bool]:
        finished, armed, iteration = (self._get(n) for n in ("finished", "armed", "iteration"))
        return self._get("progress"), iteration, bool(armed), bool(finished)

    @property
    def last_beat(self) -> float:
        """Monotonic time of the monitor process's last heartbeat (0.0 before the first)."""
        return self._get("beat")

    @property
    def store_up(self) -> bool:
        """Set by a monitor process that hosts the store, once it listens."""
        return bool(self._get("store_up"))

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
          heartbeat_timeout: float = 5.0, policy=None, idle_exit: float = 30.0) -> tuple[MonitorProcess, Progress]:
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
        proc = MonitorProcess(pid)
        if host_store:  # the rank that hosts the store fails at once, and says why, if it could not
            wait_for(lambda: progress.store_up or proc.poll() is not None, 60.0, f"the store on {store_host}:{store_port}",
                     interval=0.002)
            if not progress.store_up:
                progress.close()
                raise RuntimeError(f"rank {rank} could not host the in-process restart store on {store_host}:{store_port} "
                                   "(its error is above; the port may be taken: pass Wrapper(store_port=...))")
        return proc, progress
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
        policy = policy or ShiftRanks()
        judge = Judge(world_size, heartbeat_interval, heartbeat_timeout, policy) if rank == 0 else None
        code = _run(rank, world_size, store_host, store_port, host_store, hard_timeout, interval,
                    heartbeat_interval, idle_exit, progress, parent, judge, policy)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run(rank, world_size, store_host, store_port, host_store, hard_timeout, interval, heartbeat_interval,
         idle_exit, progress: Progress, parent_pid: int, judge: Judge | None, policy) -> int:
    from . import store as st

    server = st.host(store_port, bind=store_host) if host_store else None
    progress._put("store_up", int(server is not None))
    client = st.RestartStore(st.connect(store_host, store_port))
    parent_gone = False
    next_beat = 0.0
    while not parent_gone:
        time.sleep(interval)
        last, iteration, armed, finished = progress.read()
        if time.monotonic() >= next_beat and os.getppid() == parent_pid:
            client.beat(rank)
            progress._put("beat", time.monotonic())  # the rank's monitor thread beats only if these stop
            next_beat = time.monotonic() + heartbeat_interval
        if judge is not None:
            judge.tick(client)
        if os.getppid() != parent_pid:
            parent_gone = True
            if not finished:
                _report_dead(client, rank, iteration, "dead", "process exited without finishing (killed?)",
                             world_size, policy)
        elif armed and time.monotonic() - last > hard_timeout:
            os.kill(parent_pid, signal.SIGKILL)
            parent_gone = True
            _report_dead(client, rank, iteration, "hard_timeout",
                         f"no progress for {time.monotonic() - last:.1f} s > hard_timeout {hard_timeout} s; killed",
                         world_size, policy)
        elif finished:
            parent_gone = True
    client.leave(rank)
    if server is not None:  # keep the store up for the others
        _serve_until_idle(client, world_size, idle_exit, judge or Judge(world_size, heartbeat_interval, 1e9, policy))
    return 0


def _report_dead(client, rank: int, iteration: int, cause: str, detail: str, world_size: int, policy) -> None:
    from .rendezvous import help_decide

    t = time.time()
    # the report first: a survivor that sees the death may attribute the restart at once
    client.report_fault(iteration, rank, cause, detail, t)
    client.announce_death(rank, cause, detail, t)
    help_decide(client, policy, world_size)


class Judge:
    """The store host's heartbeat judge: one ``multi_get`` of every counter per interval."""

    def __init__(self, world_size: int, interval: float, timeout: float, policy):
        self.world_size, self.interval, self.timeout, self.policy = world_size, interval, timeout, policy
        self.seen: dict[int, tuple[int, float]] = {}
        self.judged: set[int] = set()
        self.next = 0.0
        self.last_change = time.monotonic()
        """When any counter last moved (the host stops serving once nobody beats)."""

    def tick(self, client) -> list[int]:
        """Judge once per interval; returns the ranks declared dead now."""
        now = time.monotonic()
        if now < self.next:
            return []
        self.next = now + self.interval
        beats = client.heartbeats(self.world_size, started=bool(self.seen))
        if beats is None:
            return []  # not every rank has started: rendezvous 0's timeout covers a rank that never does
        stale = []
        for r, count in beats.items():
            seen = self.seen.get(r)
            if seen is None or seen[0] != count:
                self.seen[r] = (count, now)
                self.last_change = now
            elif now - seen[1] > self.timeout and r not in self.judged:
                stale.append(r)
        if stale:
            self.judged |= set(stale)
            stale = sorted(set(stale) - client.dead_ranks() - client.gone_ranks())
        for r in stale:
            silent = now - self.seen[r][1]
            _report_dead(client, r, max(client.latest_decided(), 0), "dead",
                         f"no heartbeat for {silent:.1f} s > heartbeat_timeout {self.timeout} s (judged by the store host)",
                         self.world_size, self.policy)
        return stale


def _serve_until_idle(client, world_size: int, idle_exit: float, judge: Judge) -> None:
    while not client.all_gone(world_size):
        judge.tick(client)
        if time.monotonic() - judge.last_change > idle_exit:
            return
        time.sleep(0.1)
    time.sleep(0.5)  # let the last clients finish their calls
