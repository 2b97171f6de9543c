"""The writer: one persistent background process per rank, started once and reused (trainer side).

A thread would share the GIL with training and stall its Python work for the length of the write;
a process per save would pay ``import torch`` (~1.5 s) every time. So each rank starts one writer
when the :class:`~nvrx_lab.checkpoint.AsyncCheckpointer` is created (:mod:`.writer_main`: forked in
milliseconds, or a clean interpreter in ~2 s) and talks to it over a socket pair:

* request: step, temporary folder, the rank's final DCP plan, the staging region's path and the
  :class:`~.staging.Slot` of each tensor item, the serialised non-tensor values, the bandwidth cap.
  No tensor ever crosses the socket (see :mod:`.staging` for why);
* response: ``("done", step, info)`` with the rank's files (size, CRC32C), pickled DCP write results
  and seconds, or ``("error", step, info)`` with the path and errno.

The trainer's reader thread posts each outcome on the completion board (:mod:`.completion`) the
moment it arrives, through the callback given to :meth:`WriterProcess.submit`, so rank 0 learns
of it even while this rank's training loop is busy elsewhere; a writer that dies mid-write is
posted as a failure too.

Until the writer says ``ready``, a submitted request is held in the trainer and sent the moment it
is; the checkpointer's next save waits for it (a save is never dropped because its writer starts).

The writer maps the staging region (once per region), builds exact-size tensor views over it,
writes with :func:`~.shards.write_shards` and answers; it writes nothing else.
Once mapped, the region's name is removed, so a trainer killed mid-write leaves nothing in
``/dev/shm`` (one killed while staging, before the writer mapped the region, still does).
It exits the moment its trainer is gone, mid-write too: a thread blocks on a pipe whose only write
end the trainer holds. Only the trainer commits, so the rest of an orphaned write is of no use, and
it would hold the staging memory and the storage bandwidth of the restarted job. It ignores
``SIGXFSZ`` so a file-size limit surfaces as ``EFBIG`` instead of killing it. If it dies anyway
(SIGKILL, OOM, a failed start), :meth:`WriterProcess.poll` reports ``("died", ...)`` with the exit
code and the last line it printed, and the checkpointer starts a new one at the next save.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from nvrx_lab import liveness
from nvrx_lab.net import wait_for

from .priority import WriterPriority
from .writer_main import ForkedWriter, can_fork, command

log = logging.getLogger(__name__)


class WriterProcess:
    """Trainer side of one rank's writer: submit a request, poll for its outcome.

    The writer is forked from the trainer when :func:`can_fork` (ready in milliseconds), else started
    as a clean interpreter (``fork=False`` asks for that; ~2 s, it imports torch). One request at a
    time. A request submitted before the writer is ready is held here and sent by the reader thread
    when ``ready`` arrives (:attr:`ready`, :meth:`wait_ready`)."""

    def __init__(self, rank: int = 0, priority: WriterPriority | None = None, fork: bool | None = None):
        self.rank = rank
        priority = priority or WriterPriority()
        self.forked = can_fork() if fork is None else fork and can_fork()
        ours, theirs = socket.socketpair()
        death_r, self._death_w = os.pipe()  # both ends non-inheritable: only the writer gets death_r
        self._stderr = tempfile.TemporaryFile()
        self.started_at = time.monotonic()
        try:
            if self.forked:
                self.process = ForkedWriter(theirs.fileno(), death_r, self._stderr.fileno(), priority)
            else:
                self.process = subprocess.Popen(
                    command(theirs.fileno(), death_r, priority), pass_fds=(theirs.fileno(), death_r),
                    stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=self._stderr)
        finally:
            theirs.close()
            os.close(death_r)
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.ready_s: float | None = None
        """Seconds from the start to ``ready`` (how long a save could have had to wait for it)."""
        self._unsent: dict | None = None
        self._on_outcome: Callable[[str, dict], object] | None = None
        self._responses: queue.Queue = queue.Queue()
        self.in_flight: dict | None = None
        threading.Thread(target=self._read, daemon=True, name=f"nvrx-ckpt-writer-{rank}-reader").start()

    def _read(self) -> None:
        """Reader thread: ``ready`` releases a held request; outcomes are announced, then go to :meth:`poll`."""
        while True:
            try:
                kind, step, info = self._conn.recv()
            except (EOFError, OSError):
                self._announce("died", None)
                self._responses.put(None)  # the writer is gone (or closed)
                return
            if kind == "ready":
                for why in info.get("not_applied", ()):
                    log.warning("checkpoint writer of rank %d runs at the trainer's priority: %s", self.rank, why)
                with self._lock:
                    self.ready_s = time.monotonic() - self.started_at
                    self._ready.set()
                    if self._unsent is not None:
                        self._send(self._unsent)
                        self._unsent = None
            else:
                self._announce(kind, info)
                self._responses.put((kind, step, info))

    def _announce(self, kind: str, info: dict | None) -> None:
        """Hand the outcome of the request in flight to its ``on_outcome`` callback, once."""
        with self._lock:
            callback, self._on_outcome = self._on_outcome, None
        if callback is None:
            return
        if kind == "died":
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
            info = {"why": self.why(), "tmp": (self.in_flight or {}).get("tmp")}
        try:
            callback(kind, info)
        except Exception:  # noqa: BLE001 - the store may be gone (a restart): the trainer still polls
            log.warning("writer of rank %d: could not announce a %s outcome", self.rank, kind, exc_info=True)

    def _send(self, msg: dict) -> None:
        try:
            self._conn.send(msg)
        except OSError:  # the writer died: poll() reports it
            pass

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the writer has imported torch and is listening; raise at once if it died."""
        wait_for(self._started, timeout, f"the checkpoint writer of rank {self.rank} to be ready", interval=0.0,
                 on_poll=liveness.beat)

    def _started(self) -> bool:
        if self._ready.wait(0.05):
            return True
        if not self.alive():
            raise RuntimeError(f"the checkpoint writer of rank {self.rank} could not start: {self.why()}")
        return False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def alive(self) -> bool:
        return self.process.poll() is None

    def why(self) -> str:
        """The writer's exit code and the last line it printed (why it died)."""
        code = self.process.poll()
        try:
            self._stderr.seek(0)
            lines = [ln for ln in self._stderr.read()[-4096:].decode(errors="replace").splitlines() if ln.strip()]
        except ValueError:  # closed: the trainer closed the writer meanwhile (a reader thread asks late)
            lines = []
        return f"exit code {code}" + (f": {lines[-1].strip()}" if lines else "")

    def submit(self, msg: dict, on_outcome: Callable[[str, dict], object] | None = None) -> None:
        """Send ``msg`` (held until the writer is ready); ``on_outcome(kind, info)`` runs in the reader
        thread when its outcome arrives (``died`` too), before :meth:`poll` returns it."""
        if self.in_flight is not None:
            raise RuntimeError(f"writer of rank {self.rank} is busy with step {self.in_flight['step']}")
        self.in_flight = {"step": msg["step"], "tmp": msg["tmp"]}
        with self._lock:
            self._on_outcome = on_outcome
            if self._ready.is_set():
                self._send(msg)
            else:
                self._unsent = msg

    def poll(self, timeout: float = 0.0) -> tuple[str, int, dict] | None:
        """Outcome of the request in flight: ("done"|"error"|"died", step, info), or None if still busy."""
        if self.in_flight is None:
            return None
        try:
            got = self._responses.get(timeout=timeout) if timeout > 0 else self._responses.get_nowait()
        except queue.Empty:
            return None
        if got is None:
            self._responses.put(None)  # stays dead for later polls
            self.process.wait()
            lost, self.in_flight = self.in_flight, None
            return "died", lost["step"], {"exitcode": self.process.returncode, "why": self.why(), "tmp": lost["tmp"]}
        self.in_flight = None
        return got

    def wait(self, timeout: float) -> tuple[tuple[str, int, dict] | None, float]:
        """Wait for the outcome of the request in flight: the writer's start if it is still starting, then
        the write, beating :mod:`nvrx_lab.liveness` meanwhile. A writer that has not answered within
        ``timeout`` is killed (its outcome is then ``died``). Returns (outcome, seconds spent waiting for
        the writer to start)."""
        t0, starting = time.monotonic(), not self.ready
        try:
            outcome = wait_for(lambda: self.poll(timeout=0.05), timeout, f"the writer of rank {self.rank} to finish "
                               f"step {self.in_flight['step']}", interval=0.0, on_poll=liveness.beat)
        except TimeoutError:
            self.process.kill()
            outcome = self.poll(timeout=10.0)
        ready_at = self.started_at + self.ready_s if self.ready_s is not None else time.monotonic()
        return outcome, max(0.0, ready_at - t0) if starting else 0.0

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer; the request in flight, if any, is announced no more (its save is over for the caller)."""
        with self._lock:
            self._on_outcome = None
        if self.alive():
            self._send(None)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._conn.close()
        for closer in (lambda: os.close(self._death_w), self._stderr.close):
            try:
                closer()
            except OSError:
                pass
