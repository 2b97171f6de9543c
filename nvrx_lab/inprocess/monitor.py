"""The monitor thread: one per rank, alive for the whole wrapped call
====================================================================

Every ``interval`` seconds it

* stands in for the rank's monitor process as its heartbeat (``hb/<rank>``), every
  ``heartbeat_interval``, once the process's beats (noted in the shared page) are two intervals
  late: a rank looks dead only when both stop, and the store gets one beat a rank, not two. It
  reads no other rank's counter: heartbeats are judged once, by the store host (see
  :mod:`.monitor_process`), not N times over by every rank;
* while an attempt is armed: looks at the attempt's end (a local flag, set by a
  :class:`~.watch.KeyWatch` when ``it/<n>/end`` appears — no store operation per tick), and checks
  the rank's own progress — no :meth:`~.call_wrapper.CallWrapper.ping` for ``soft_timeout`` s is
  reported as a ``hang`` (which ends the attempt for everyone), with where the main thread stands (:mod:`.where`);
  a rank nearly as late when another's hang ends the attempt reports too, so the stuck rank is named;
* on a fault: waits for any :meth:`~.call_wrapper.CallWrapper.atomic` section to end, runs the
  abort policy (unblocks collectives, see :mod:`.interrupt`) and signals the main thread, again
  every ``resend`` s while the main thread is still inside the function.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from .interrupt import MainThreadInterrupter
from .monitor_process import Progress
from .state import State
from .store import RestartStore
from .watch import Watched
from .where import main_thread_at

HANG_TOO = 0.8
"""A rank whose last ping is this fraction of the soft timeout old when another's hang ends the attempt reports its own
(ranks in lock-step stop pinging within moments of each other; a healthy one computing is not that late)."""


@dataclass(frozen=True)
class ThreadSettings:
    """What the monitor thread acts on (built by :meth:`.wrap.Wrapper.thread_settings`)."""

    soft_timeout: float = 60.0
    """No ``ping()`` for this long (s) outside an atomic section: a ``hang`` is reported."""
    heartbeat_interval: float = 0.5
    """Seconds between heartbeats, when the thread stands in for its monitor process."""
    interval: float = 0.01
    """Tick period (s) of the thread."""
    resend: float = 0.2
    """An interrupt is sent again after this long (s) while the main thread is still in the function."""


class MonitorThread(threading.Thread):
    def __init__(self, store: RestartStore, rank: int, interrupter: MainThreadInterrupter, abort,
                 settings: ThreadSettings, page: Progress | None = None):
        super().__init__(name=f"nvrx-inprocess-monitor-{rank}", daemon=True)
        self.store, self.rank, self.interrupter, self.abort = store, rank, interrupter, abort
        self.settings = settings
        self.page = page
        """The page shared with the monitor process: this thread beats while the process's last beat there is two
        intervals old (always, without one)."""
        self.atomic_lock = threading.RLock()
        """Held by the main thread inside ``atomic()``; the monitor interrupts only between sections."""
        self.atomic_depth = 0
        """> 0 while the main thread is inside ``atomic()``: no soft timeout there (the hard one still holds)."""
        self.last_ping = time.monotonic()
        """Monotonic time of the main thread's last progress signal (written by the main thread)."""
        self._lock = threading.Lock()
        self._abort_lock = threading.Lock()
        self._stop_event = threading.Event()
        self._state: State | None = None
        self._end: Watched | None = None
        self._hang_reported = False
        self.interrupting = False
        """Set once this attempt is being interrupted; ``atomic()`` refuses to start then."""
        self.detected_at: float | None = None
        """Wall time at which this thread noticed the attempt's fault."""
        self.error: BaseException | None = None

    # -- called by the main thread -----------------------------------------------------------
    def arm(self, state: State, end: Watched) -> None:
        """Watch attempt ``state.iteration``; ``end`` is the watch on its end key."""
        with self._lock:
            self._state, self._end = state, end
            self._hang_reported = False
            self.interrupting = False
            self.detected_at = None
            self.last_ping = time.monotonic()

    def disarm(self) -> None:
        """After this returns no abort is running and none will start (the main thread may now
        close the attempt's sockets without racing a cut on reused fd numbers)."""
        with self._abort_lock, self._lock:
            self._state = None

    def stop(self, timeout: float = 5.0) -> None:
        self._stop_event.set()
        self.join(timeout)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        # The thread's periodic loop for the whole wrapped call, not a wait: every tick it beats (when its
        # monitor process does not), watches the armed attempt's end and progress, and re-sends an interrupt.
        cfg = self.settings
        next_beat = 0.0
        last_signal = 0.0
        while not self._stop_event.wait(cfg.interval):
            try:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + cfg.heartbeat_interval
                    if self.page is None or now - self.page.last_beat > 2 * cfg.heartbeat_interval:
                        self.store.beat(self.rank)
                with self._lock:
                    state, end = self._state, self._end
                if state is None:
                    continue
                if not self.interrupting:
                    if end.is_set() and self._ended_by_fault(state, end):
                        self._also_hung(state, now)
                        self._interrupt(state)
                        last_signal = time.monotonic()
                    elif (not self._hang_reported and not self.atomic_depth
                          and now - self.last_ping > cfg.soft_timeout):
                        self._report_hang(state, now)
                elif self.interrupter.armed and now - last_signal > cfg.resend:
                    self.interrupter.interrupt(self.interrupter.reason)
                    last_signal = now
            except Exception as e:  # the store went away: nothing left to coordinate with
                self.error = e
                if self._stop_event.wait(0.5):
                    return

    def _report_hang(self, state: State, now: float) -> None:
        """This rank's hang, saying where its main thread stands (:mod:`.where`): waiting on a peer, or stuck itself."""
        self._hang_reported = True
        waiting, where = main_thread_at()
        self.store.report_fault(state.iteration, self.rank, "hang",
                                f"no ping for {now - self.last_ping:.2f} s (soft_timeout {self.settings.soft_timeout} s), "
                                f"{'waiting in' if waiting else 'stuck in'} {where}",
                                time.time() - (now - self.last_ping), waiting=waiting)

    def _also_hung(self, state: State, now: float) -> None:
        """Another rank's hang ended the attempt, and this one has not pinged for most of the soft timeout either: it
        reports too, so that the rank stuck outside a collective is named (.restart_log.root_cause), not the first
        peer waiting for it in one to notice."""
        if self._hang_reported or self.atomic_depth or now - self.last_ping < HANG_TOO * self.settings.soft_timeout:
            return
        try:
            if any(f["cause"] == "hang" for f in self.store.faults(state.iteration)):
                self._report_hang(state, now)
        except Exception as e:  # a courtesy to the restart log: the interrupt that follows goes out whatever happens
            print(f"[nvrx_lab.inprocess] rank {self.rank}: its own hang report was not added ({type(e).__name__}: {e}); "
                  "the first report names the hang", file=sys.stderr, flush=True)

    def _ended_by_fault(self, state: State, end: Watched) -> bool:
        """Read once per attempt: ``done`` (every rank returned) is no fault; a failed wait is."""
        if end.error is None and end.value is None:
            end.value = self.store.end(state.iteration)
        return end.error is not None or end.value != "done"

    def _interrupt(self, state: State) -> None:
        with self._abort_lock:
            if self._state is not state:
                return  # disarmed meanwhile
            if not self.atomic_lock.acquire(blocking=False):
                return  # the main thread is in an atomic section: try again next tick
            try:
                self.interrupting = True
            finally:
                self.atomic_lock.release()
            self.detected_at = time.time()
            try:
                self.abort(state)
            finally:  # the faults themselves are read once, for the restart record
                self.interrupter.interrupt(f"attempt {state.iteration} interrupted: a fault was reported")
