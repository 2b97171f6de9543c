"""Warm standby workers: a restart that does not pay ``import torch`` again.

torchelastic starts every worker with ``Popen([python, -u, script, ...])``, so each restart pays
interpreter start plus ``import torch`` (~1.3 s on 2 CPU cores). A process that has already imported
torch cannot be handed to ``Popen``, so the warm copy lives next to torchelastic instead of inside it:

* the launcher starts one **zygote** per node: a Python process that imports torch (and
  ``--standby-preload`` modules), never touches CUDA, and keeps one **pre-forked standby child per
  local rank** blocked on a socket;
* torchelastic still starts (and monitors, signals, logs) each worker, but its command is the tiny
  stdlib-only :mod:`nvrx_lab.launcher.attach` (~20 ms): it hands its environment, argv, cwd and
  stdio file descriptors (``SCM_RIGHTS``) to the zygote; a standby takes them over and runs the
  real entrypoint with ``runpy`` in a process where torch is already imported; the zygote forks a
  replacement standby at once;
* exit status flows back: the zygote reaps the worker and sends its exit code or signal to the
  attach process, which exits the same way, so torchelastic sees exactly what happened (``-9``).
  Both ends of the hand-over (the job's message, sent and adopted) are in :mod:`~nvrx_lab.launcher.attach`.
  SIGTERM to the attach process is forwarded; if the attach process is SIGKILLed (the launcher's
  escalation), the zygote sees its socket close and SIGKILLs the worker. Standbys and workers die
  with the zygote (``PR_SET_PDEATHSIG``), the zygote with the launcher.

On GPUs the same holds as long as CUDA is first initialised in the worker, never in the zygote
(forking an initialised CUDA context is undefined); the zygote imports torch only.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import traceback

from nvrx_lab.launcher.attach import adopt
from nvrx_lab.launcher.monitor import is_descendant, peer_credentials
from nvrx_lab.net import wait_for

MAX_MSG = 1 << 20
ATTACH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attach.py")


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies, and leave now if it died already (before the ``prctl``: a launcher
    that exits while its zygote is still starting would otherwise leave it running)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


class Zygote:
    """Launcher-side handle of the zygote process (start, wrap the entrypoint, kill workers, close)."""

    def __init__(self, directory: str, nstandby: int, preload: list[str]):
        self.path = os.path.join(directory, "zygote.sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "nvrx_lab.launcher.standby", self.path,
                                      str(nstandby), ",".join(preload), str(os.getpid())])
        self._ctl: socket.socket | None = None

    def wrap(self, cmd: str, args: list[str]) -> tuple[str, list[str]]:
        """torchelastic's ``(python, [-u, script, ...])`` -> the attach command for the same run."""
        if os.path.basename(cmd).startswith("python") or cmd == sys.executable:
            return sys.executable, ["-u", "-s", ATTACH_SCRIPT, self.path, *args]
        raise ValueError(f"--standby needs a Python entrypoint; got --no-python command {cmd!r}")

    def _control(self, timeout: float = 60.0) -> socket.socket:
        if self._ctl is None:
            self._ctl = wait_for(self._connect_control, timeout, f"the standby zygote to listen at {self.path}")
        return self._ctl

    def _connect_control(self) -> socket.socket | None:
        """The control connection, or ``None`` while the zygote is not listening yet; raises if it exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"standby zygote exited with {self.proc.returncode}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(self.path)
            s.send(json.dumps({"op": "ctl"}).encode())
        except OSError:
            s.close()
            return None
        return s

    def kill_workers(self, timeout: float = 10.0) -> int:
        """SIGKILL every worker the zygote still runs and wait until they are reaped; returns how many."""
        ctl = self._control()
        ctl.settimeout(timeout)
        ctl.send(b'{"op": "kill"}')
        return json.loads(ctl.recv(MAX_MSG))["killed"]

    def close(self) -> None:
        if self._ctl is not None:
            self._ctl.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------ zygote process
_ZYGOTE_SOCKETS: list[socket.socket] = []  # closed in each standby (the zygote's own ends)


def _fork_standby() -> tuple[int, socket.socket]:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        for s in [parent_end, *_ZYGOTE_SOCKETS]:
            try:  # raw close: these objects are never touched again here (we leave with os._exit)
                os.close(s.fileno())
            except OSError:
                pass
        try:
            code = _standby(child_end, zygote)
        except BaseException:  # noqa: BLE001 - report and exit, never return into the zygote loop
            traceback.print_exc()
            code = 1
        os._exit(code)
    child_end.close()
    _ZYGOTE_SOCKETS.append(parent_end)
    return pid, parent_end


def _standby(sock: socket.socket, zygote: int) -> int:
    """In a forked child: wait for a job, then become its worker (:func:`~nvrx_lab.launcher.attach.adopt`)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    _die_with_parent(zygote)
    return adopt(sock)


def serve(path: str, nstandby: int, preload: list[str], launcher: int) -> None:
    """The zygote's loop: keep ``nstandby`` standbys, hand jobs over, reap, report exits."""
    _die_with_parent(launcher)
    for name in preload:
        importlib.import_module(name)
    gc.collect()  # what the imports made moves to the permanent generation: every worker forked from here skips
    gc.freeze()  # it in each collection (a full one of torch + dynamo is ~0.17 s at a worker's start on 2 cores)
    _ZygoteLoop(path, nstandby).run()


def _send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.send(json.dumps(obj).encode())
    except OSError:
        pass


class _ZygoteLoop:
    """The zygote's state: standbys waiting for a job, running workers with their attach connections,
    and the launcher's control connection."""

    def __init__(self, path: str, nstandby: int):
        self.launcher = os.getppid()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _ZYGOTE_SOCKETS.append(self.listener)
        self.standbys = [_fork_standby() for _ in range(nstandby)]
        self.running: dict[int, socket.socket] = {}  # worker pid -> its attach connection
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self.ctl: socket.socket | None = None
        self.kill_requested, self.killed = False, 0

    def run(self) -> None:
        while True:
            for key, _ in self.sel.select(timeout=0.01):
                if key.data == "listen":
                    self._accept()
                elif key.data == "ctl":
                    if not self._on_control(key.fileobj):
                        return
                else:  # an attach connection: readable means it closed (the attach process died)
                    if not key.fileobj.recv(MAX_MSG) and key.data in self.running:
                        os.kill(key.data, signal.SIGKILL)
            self._reap()
            if self.kill_requested and not self.running:
                _send(self.ctl, {"killed": self.killed})
                self.kill_requested = False

    def _accept(self) -> None:
        """A new connection: the launcher's control connection, or an attach process with a job."""
        conn, _ = self.listener.accept()
        _ZYGOTE_SOCKETS.append(conn)
        pid, uid, _ = peer_credentials(conn)
        if uid != os.getuid() or not is_descendant(pid, self.launcher):
            _ZYGOTE_SOCKETS.remove(conn)
            conn.close()
            return
        conn.settimeout(5)
        msg, fds, _, _ = socket.recv_fds(conn, MAX_MSG, 3)
        job = json.loads(msg)
        if job["op"] == "ctl":
            self.ctl = conn
            self.sel.register(conn, selectors.EVENT_READ, "ctl")
        else:
            self._hand_over(conn, msg, fds)

    def _hand_over(self, conn: socket.socket, msg: bytes, fds: list[int]) -> None:
        """Give the job and the attach process's stdio to a standby, then fork its replacement."""
        if not self.standbys:
            self.standbys.append(_fork_standby())
        wpid, wsock = self.standbys.pop(0)
        socket.send_fds(wsock, [msg], fds)
        _ZYGOTE_SOCKETS.remove(wsock)
        wsock.close()
        for fd in fds:
            os.close(fd)
        self.running[wpid] = conn
        self.sel.register(conn, selectors.EVENT_READ, wpid)
        _send(conn, {"pid": wpid})
        self.standbys.append(_fork_standby())

    def _on_control(self, ctl: socket.socket) -> bool:
        """A kill request: SIGKILL every running worker. ``False`` when the launcher is gone (and everything
        with it)."""
        if not ctl.recv(MAX_MSG):  # the launcher is gone: take everything down
            for wpid in list(self.running) + [p for p, _ in self.standbys]:
                os.kill(wpid, signal.SIGKILL)
            return False
        self.kill_requested, self.killed = True, len(self.running)
        for wpid in self.running:
            os.kill(wpid, signal.SIGKILL)
        return True

    def _reap(self) -> None:
        """Collect exited children: a worker's exit goes to its attach process; a standby is forgotten."""
        while True:
            try:
                wpid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if wpid == 0:
                return
            if wpid in self.running:
                conn = self.running.pop(wpid)
                sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
                _send(conn, {"signal": sig} if sig else {"exit": os.WEXITSTATUS(status)})
                self.sel.unregister(conn)
                _ZYGOTE_SOCKETS.remove(conn)
                conn.close()
            else:
                self.standbys = [(p, s) for p, s in self.standbys if p != wpid]


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), [m for m in sys.argv[3].split(",") if m], int(sys.argv[4]))
