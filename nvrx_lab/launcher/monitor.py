"""Rank monitors: one per local rank, living in the launcher, so they survive worker restarts.

Each local rank gets a Unix stream socket ``rank<N>.sock`` in a private directory (created 0700,
only this user can even reach the socket). On every connection the monitor also reads the peer's
credentials (``SO_PEERCRED``) and refuses a stranger: another user, or a process that is not a
descendant of the launcher. One selector thread serves all ranks and timestamps each message on
arrival; the launcher's monitor loop asks :meth:`MonitorServer.hung` which ranks exceeded their
:class:`~nvrx_lab.launcher.timeouts.Timeouts`.

Wire format (client -> monitor, one ``\\n``-terminated line each)::

    i {"pid": 123, "rank": 1, "timeouts": {...} | null}   init; the monitor answers with its timeouts
    h                                                    heartbeat (2 bytes: the hot path)
    s NAME / e NAME                                      section start / end
    t {"initial": .., "steady": .., "sections": {..}}    new timeouts (calculate_timeouts)
    q                                                    clean shutdown: stop watching this rank

A closed connection without ``q`` means the worker died; its time is recorded (``lost_at``) so the
launcher can report how long detection took.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field

from nvrx_lab.launcher.timeouts import RankClock, Timeouts, find_hang

log = logging.getLogger(__name__)

MONITOR_DIR_ENV = "NVRX_LAB_MONITOR_DIR"
LAST_FAILURE_ENV = "NVRX_LAB_LAST_FAILURE"
"""What the agent tells a restarted worker group of the failure it restarted for (JSON: t, rank, cause)."""
"""Environment variable that tells a worker where its monitor socket is."""


def socket_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"rank{local_rank}.sock")


def is_descendant(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (``False`` once it is gone)."""
    import psutil  # here, not at the top: workers import this module through the stdlib-only client

    if pid == ancestor:
        return True
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


@dataclass
class RankState:
    """The monitor's view of one local rank; reset at each (re)start of the worker group."""

    timeouts: Timeouts
    """Limits in force; the CLI's until the worker sends its own (restored from a checkpoint)."""
    clock: RankClock | None = None
    """Liveness clock, ``None`` until the worker calls ``init_workload_monitoring``."""
    pid: int | None = None
    """The worker's pid from its socket credentials."""
    lost_at: float | None = None
    """When the connection closed without a clean shutdown (the worker died)."""
    first_heartbeat_at: float | None = None
    """When the first heartbeat after the last reset arrived."""
    done: bool = False
    """The worker shut monitoring down cleanly; never reported as hung."""
    conn: socket.socket | None = None
    buf: bytearray = field(default_factory=bytearray)


class MonitorServer:
    """Per-local-rank heartbeat monitors in the launcher process (see the module docstring)."""

    def __init__(self, nranks: int, timeouts: Timeouts, directory: str | None = None):
        self.dir = directory or tempfile.mkdtemp(prefix="nvrx-lab-mon-")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.owner_pid = os.getpid()
        self.refused = 0
        """Connections refused as strangers (another user or not a descendant of the launcher)."""
        self._lock = threading.Lock()
        self._ranks = [RankState(timeouts=Timeouts.from_dict(timeouts.to_dict())) for _ in range(nranks)]
        self._sel = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        for r in range(nranks):
            path = socket_path(self.dir, r)
            if os.path.exists(path):
                os.unlink(path)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            os.chmod(path, 0o600)
            s.listen(4)
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ, ("listen", r))
            self._listeners.append(s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nvrx-rank-monitors", daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        """What the workers need in their environment to find their monitor."""
        return {MONITOR_DIR_ENV: self.dir}

    # ---------------------------------------------------------------- launcher side
    def reset(self) -> None:
        """Forget the previous workers (called before each start); timeouts are kept."""
        with self._lock:
            for st in self._ranks:
                if st.conn is not None:
                    self._drop(st)
                st.clock, st.pid, st.lost_at, st.first_heartbeat_at, st.done = None, None, None, None, False

    def hung(self, now: float | None = None) -> list[tuple[int, str, float]]:
        """``[(local_rank, reason, silent_s)]`` for every rank past its timeout, oldest silence first."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            for r, st in enumerate(self._ranks):
                if st.clock is not None and not st.done and st.lost_at is None:
                    found = find_hang(st.clock, st.timeouts, now)
                    if found:
                        out.append((r, *found))
        return sorted(out, key=lambda x: -x[2])

    def state(self, local_rank: int) -> RankState:
        with self._lock:
            return self._ranks[local_rank]

    def all_beating(self) -> bool:
        """Whether every local rank sent a heartbeat since the last reset."""
        with self._lock:
            return all(st.first_heartbeat_at is not None for st in self._ranks)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            for st in self._ranks:
                if st.conn is not None:
                    self._drop(st)
        for r, s in enumerate(self._listeners):
            s.close()
            try:
                os.unlink(socket_path(self.dir, r))
            except OSError:
                pass
        self._sel.close()
        try:
            os.rmdir(self.dir)
        except OSError:
            pass

    # ---------------------------------------------------------------- selector thread
    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.05):
                kind, r = key.data
                if kind == "listen":
                    self._accept(key.fileobj, r)
                else:
                    self._read(r, key.fileobj)

    def _accept(self, listener: socket.socket, r: int) -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        pid, uid, _ = peer_credentials(conn)
        if uid != os.getuid() or not is_descendant(pid, self.owner_pid):
            self.refused += 1
            log.warning("rank monitor %d: refused a connection from pid %d uid %d (not a worker of this launcher)",
                        r, pid, uid)
            conn.close()
            return
        conn.setblocking(False)
        with self._lock:
            st = self._ranks[r]
            if st.conn is not None:  # a restarted worker replaces the old connection
                self._drop(st)
            st.conn, st.pid, st.buf = conn, pid, bytearray()
            self._sel.register(conn, selectors.EVENT_READ, ("conn", r))

    def _read(self, r: int, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        now = time.monotonic()
        with self._lock:
            st = self._ranks[r]
            if st.conn is not conn:
                return
            if not data:
                if not st.done and st.clock is not None:
                    st.lost_at = now
                self._drop(st)
                return
            st.buf += data
            *lines, rest = st.buf.split(b"\n")
            st.buf = bytearray(rest)
            for line in lines:
                self._handle(st, line, now)

    def _handle(self, st: RankState, line: bytes, now: float) -> None:
        op, _, arg = line.partition(b" ")
        if op == b"h":
            if st.clock is not None:
                st.clock.last_heartbeat = now
                if st.first_heartbeat_at is None:
                    st.first_heartbeat_at = now
        elif op == b"s" and st.clock is not None:
            st.clock.open_sections[arg.decode()] = now
        elif op == b"e" and st.clock is not None:
            st.clock.open_sections.pop(arg.decode(), None)
            st.clock.last_section_end = now
        elif op == b"i":
            msg = json.loads(arg)
            if msg.get("timeouts"):
                st.timeouts = Timeouts.from_dict(msg["timeouts"])
            st.clock, st.done, st.lost_at = RankClock(connected_at=now), False, None
            self._reply(st, json.dumps(st.timeouts.to_dict()).encode() + b"\n")
        elif op == b"t":
            st.timeouts = Timeouts.from_dict(json.loads(arg))
        elif op == b"q":
            st.done = True

    def _reply(self, st: RankState, payload: bytes) -> None:
        try:
            st.conn.setblocking(True)
            st.conn.sendall(payload)
            st.conn.setblocking(False)
        except OSError:
            self._drop(st)

    def _drop(self, st: RankState) -> None:
        try:
            self._sel.unregister(st.conn)
        except (KeyError, ValueError):
            pass
        st.conn.close()
        st.conn = None
