"""The monitor process: one per rank, the part that survives the rank
====================================================================

A thread cannot rescue a process that is frozen in native code or killed, so each rank starts a
small child process (forked at start, so it needs no second ``import torch``) that:

* **hard timeout** — reads the rank's last progress time from shared memory (``memfd``, written
  by ``ping`` and by the wrapper's own phases); if none for ``hard_timeout`` while armed, it
  SIGKILLs the rank, says so on stderr, then reports it dead so the others continue without it;
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

import math
import mmap
import os
import signal
import struct
import sys
import time
import traceback
from contextlib import suppress
from dataclasses import dataclass, field

from nvrx_lab.net import wait_for

from .rank_assignment import RankAssignment, ShiftRanks

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


@dataclass(frozen=True)
class ProcessSettings:
    """What a rank's monitor process needs (built by :meth:`.wrap.Wrapper.process_settings`)."""

    rank: int
    """Initial rank (``RANK``) of the rank this process watches; rank 0's also judges every heartbeat."""
    world_size: int
    """``WORLD_SIZE`` at launch."""
    store_host: str
    """Host of the wrapper's store."""
    store_port: int
    """Port of the wrapper's store."""
    host_store: bool = False
    """This process hosts the store (and keeps hosting it after its rank is gone)."""
    hard_timeout: float = math.inf
    """No progress for this long (s) while armed: SIGKILL the rank (``inf``: never)."""
    interval: float = 0.02
    """Poll period (s) of the shared page and the parent's liveness."""
    heartbeat_interval: float = 0.5
    """Seconds between heartbeats in the store."""
    heartbeat_timeout: float = 5.0
    """A rank whose counter stood still this long (s) is dead (judged by the store host)."""
    policy: RankAssignment = field(default_factory=ShiftRanks)
    """The rank assignment a death notice decides an open rendezvous with."""
    idle_exit: float = 30.0
    """The store host stops serving once no rank beat for this long (s)."""


def start(cfg: ProcessSettings) -> tuple[MonitorProcess, Progress]:
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
        if cfg.host_store:  # the rank that hosts the store fails at once, and says why, if it could not
            where = f"{cfg.store_host}:{cfg.store_port}"
            wait_for(lambda: progress.store_up or proc.poll() is not None, 60.0, f"the store on {where}",
                     interval=0.002)
            if not progress.store_up:
                progress.close()
                raise RuntimeError(f"rank {cfg.rank} could not host the in-process restart store on {where} "
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
                with suppress(OSError):
                    os.close(fd)
        code = _run(cfg, progress, parent)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _run(cfg: ProcessSettings, progress: Progress, parent_pid: int) -> int:
    from . import store as st

    server = st.host(cfg.store_port, bind=cfg.store_host) if cfg.host_store else None
    progress._put("store_up", int(server is not None))
    client = st.RestartStore(st.connect(cfg.store_host, cfg.store_port))
    judge = Judge(cfg.world_size, cfg.heartbeat_interval, cfg.heartbeat_timeout, cfg.policy) if cfg.rank == 0 else None
    parent_gone = False
    next_beat = 0.0
    # The process's periodic loop for as long as its rank lives, not a wait: every tick it beats, judges the
    # heartbeats (rank 0's) and watches the rank's progress and liveness; the rank's end is one of its outcomes.
    while not parent_gone:
        time.sleep(cfg.interval)
        last, iteration, armed, finished = progress.read()
        if time.monotonic() >= next_beat and os.getppid() == parent_pid:
            client.beat(cfg.rank)
            progress._put("beat", time.monotonic())  # the rank's monitor thread beats only if these stop
            next_beat = time.monotonic() + cfg.heartbeat_interval
        if judge is not None:
            judge.tick(client)
        if os.getppid() != parent_pid:
            parent_gone = True
            if not finished:
                _report_dead(client, cfg.rank, iteration, "dead", "process exited without finishing (killed?)",
                             cfg.world_size, cfg.policy)
        elif armed and time.monotonic() - last > cfg.hard_timeout:
            os.kill(parent_pid, signal.SIGKILL)
            parent_gone = True
            detail = f"no progress for {time.monotonic() - last:.1f} s > hard_timeout {cfg.hard_timeout} s; killed"
            print(f"[nvrx_lab.inprocess] rank {cfg.rank}'s monitor process, attempt {iteration}: {detail}", file=sys.stderr,
                  flush=True)  # said here too: where every rank is killed no survivor's RESTART line says it
            _report_dead(client, cfg.rank, iteration, "hard_timeout", detail, cfg.world_size, cfg.policy)
        elif finished:
            parent_gone = True
    client.leave(cfg.rank)
    if server is not None:  # keep the store up for the others
        _serve_until_idle(client, cfg.world_size, cfg.idle_exit,
                          judge or Judge(cfg.world_size, cfg.heartbeat_interval, 1e9, cfg.policy))
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
    """Host the store, judging heartbeats, until every rank has left or is known dead, or nobody beat for ``idle_exit`` s."""
    def over() -> bool:
        return client.all_gone(world_size) or time.monotonic() - judge.last_change > idle_exit

    wait_for(over, math.inf, "every rank to leave the store", interval=0.1, on_poll=lambda: judge.tick(client))
    time.sleep(0.5)  # let the last clients finish their calls
