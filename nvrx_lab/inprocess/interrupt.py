"""Interrupting a main thread wherever it blocks
=================================================

A restart is only as fast as the slowest rank leaves its current attempt. Three places a main
thread can sit, and what gets it out (measured on torch 2.13, CPU/gloo; see
``tests/test_inprocess.py`` and ``tests/workers/inprocess_gloo_cut.py``):

* **Python code, ``time.sleep``, a blocking socket read, ``Lock.acquire``** — a signal sent to
  the main thread (``signal.pthread_kill(main, SIGUSR1)``) makes the syscall return with EINTR;
  our handler raises :class:`RankShouldRestart`, and Python propagates it out of the call.
  ``PyThreadState_SetAsyncExc`` (what NVRx uses) only fires at the next bytecode, so it cannot
  interrupt a sleep or a blocked read.
* **A gloo collective** — the main thread waits in C++ with the GIL released; signals do not
  end the wait, and neither do ``ProcessGroup.abort()``, ``shutdown()``, ``_abort_process_group``
  nor ``destroy_process_group`` from another thread (they return, the wait goes on until the peer
  process exits). What ends it is the transport: ``shutdown(SHUT_RDWR)`` on the group's connected
  TCP sockets makes gloo's pair fail with "Connection closed by peer" at once, here *and* on the
  peer. The listening socket must be left alone (gloo aborts the process on ``accept`` EINVAL).
  The sockets are the ones the attempt opened: :class:`SocketTracker` diffs ``/proc/self/fd``
  around ``init_process_group`` once the full mesh is there (one per peer: gloo connects some pairs
  only after ``init_process_group`` has returned); while the group initialises, the store client its rendezvous
  uses is cut too (and replaced afterwards), so a rendezvous blocked on a dead peer ends as well.
* **An NCCL collective** — ``ProcessGroupNCCL.abort()`` (in :mod:`.abort`), guarded by CUDA,
  always *before* the cut. NCCL's own bootstrap and proxy sockets are never tracked: shutting
  them down under a live communicator breaks NCCL instead of aborting it. So the NCCL part of a
  ``cpu:gloo,cuda:nccl`` group is connected only after the tracked window closes
  (:meth:`~.call_wrapper.CallWrapper.init_process_group`: ``commit()`` before the eager connect,
  ``end_init()`` after it, so the store client it reads NCCL's unique id from stays cuttable).

What none of these reach (a native loop that blocks signals, a hung CUDA kernel) is left to the
hard timeout of :mod:`.monitor_process`.

An interrupt that arrives while the main thread is importing a module waits for the import to end (the
monitor re-sends it): raised inside the import, it would leave that module half-initialised in
``sys.modules``, and every later attempt would fail on it (``partially initialized module 'torch._dynamo'``,
seen when a loaded box took over the soft timeout to import it in the first step).
"""

from __future__ import annotations

import signal
import sys
import threading

from nvrx_lab.net import wait_for
from nvrx_lab.sockets import shutdown_connected, socket_fds

INTERRUPT_SIGNAL = signal.SIGUSR1
"""The signal sent to the main thread; its handler raises :class:`RankShouldRestart` while armed."""


class RankShouldRestart(BaseException):
    """Raised in the main thread to end the current attempt. A ``BaseException``, so a training
    loop's ``except Exception`` does not swallow it."""


class MainThreadInterrupter:
    """Installs the signal handler (main thread only) and arms it around the wrapped function.

    Raising only while :attr:`armed` keeps the wrapper's own restart code safe from late signals.
    """

    def __init__(self, sig: signal.Signals = INTERRUPT_SIGNAL):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the in-process Wrapper must be called from the main thread (it handles signals)")
        self.sig = sig
        self.armed = False
        self.reason = ""
        self._deferred: str | None = None  # the module whose import an interrupt waits for (said once)
        self._previous = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        if not self.armed:
            return
        if (module := importing(frame)) is not None:  # the monitor re-sends while armed: raised after the import
            if module != self._deferred:
                self._deferred = module
                print(f"[nvrx_lab.inprocess] interrupt deferred until the main thread has imported {module} "
                      "(raised inside an import, it would leave the module half-initialised)", file=sys.stderr, flush=True)
            return
        self._deferred = None
        raise RankShouldRestart(self.reason or "interrupted by the in-process monitor")

    def interrupt(self, reason: str) -> None:
        """From any thread: make the main thread raise (if armed)."""
        self.reason = reason
        signal.pthread_kill(threading.main_thread().ident, self.sig)

    def restore(self) -> None:
        self.armed = False
        signal.signal(self.sig, self._previous)


def importing(frame) -> str | None:
    """The module being imported where ``frame`` runs (its innermost), or None outside any import."""
    module = None
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            spec = frame.f_locals.get("spec") or frame.f_locals.get("module")
            return module or getattr(spec, "name", None) or getattr(spec, "__name__", None) or "a module"
        module = module or (frame.f_globals.get("__name__") if frame.f_code.co_name == "<module>" else None)
        frame = frame.f_back
    return None


class SocketTracker:
    """Remembers which sockets the current attempt opened, so an abort can cut exactly those.

    ``begin()`` snapshots the sockets before the attempt's process group exists; ``commit()``
    (right after the group's gloo part is connected) fixes the set: sockets opened later (NCCL's)
    are never cut. ``end_init()`` closes the initialisation: until then the ``init_only``
    sockets (the store client a rendezvous reads from) are cut too. ``cut()`` from any thread
    shuts the attempt's connected sockets down — before ``commit()`` it uses "everything opened
    since ``begin()``".
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._before: set[int] | None = None
        self._initializing = False
        self._owned: set[int] = set()
        self._init_only: set[int] = set()
        self.cut_init_only = False
        """True once a cut hit the ``init_only`` sockets: their owner must reconnect."""

    def begin(self, init_only: set[int] | None = None) -> None:
        """Start tracking; ``init_only`` (e.g. the long-lived store client the group rendezvous
        uses) is cut too, but only until :meth:`end_init`."""
        with self._lock:
            self._before = socket_fds()
            self._init_only = set(init_only or ())
            self._initializing = True

    def await_connected(self, n: int, timeout: float) -> int:
        """Wait until ``n`` connected TCP sockets were opened since :meth:`begin` (at most ``timeout`` s);
        returns how many there are. gloo's ``init_process_group`` returns before its full mesh exists on
        every rank: at 16 ranks here, 10 of a rank's 15 pair sockets were there when it returned, the last
        ones ~1 ms later. Fixed without them, a cut misses them, and a rank waiting on one stays in its
        collective until the hard timeout kills it (2 of 10 restarts at 16 ranks)."""
        have = 0

        def enough() -> bool:
            nonlocal have
            with self._lock:
                new = socket_fds() - self._before if self._before is not None else set()
            have = shutdown_connected(new, shut=False)
            return have >= n

        try:
            wait_for(enough, timeout, f"{n} connected sockets of the new group", interval=0.001)
        except TimeoutError:
            pass  # fixed with those there are: the caller's group is up, and the hard timeout stays the backstop
        return have

    def commit(self) -> None:
        """Fix the tracked set: what was opened since :meth:`begin`; nothing opened later."""
        with self._lock:
            self._commit()

    def end_init(self) -> None:
        """The group is fully initialised: the ``init_only`` sockets are no longer cut."""
        with self._lock:
            self._commit()
            self._initializing = False

    def _commit(self) -> None:
        if self._before is not None:
            self._owned |= socket_fds() - self._before
            self._before = None

    @property
    def owned(self) -> set[int]:
        """The fds a cut reaches after initialisation (for tests and diagnostics)."""
        with self._lock:
            return set(self._owned)

    def cut(self) -> int:
        with self._lock:
            fds = set(self._owned)
            if self._before is not None:
                fds |= socket_fds() - self._before
            if self._initializing:
                fds |= self._init_only
                self.cut_init_only = self.cut_init_only or bool(self._init_only)
            return shutdown_connected(fds)

    def reset(self) -> None:
        """After the attempt's group and store are destroyed: forget the (now closed) fds."""
        with self._lock:
            self._before = None
            self._initializing = False
            self._owned = set()
            self._init_only = set()
