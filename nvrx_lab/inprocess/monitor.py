"""The monitor thread: one per rank, alive for the whole wrapped call
====================================================================

Every ``interval`` seconds it

* beats this rank's heartbeat counter (``hb/<rank>``) and watches the peers' counters every
  ``heartbeat_interval``; a peer whose counter has not moved for ``heartbeat_timeout`` is *stale*
  (reported as a fault while an attempt runs, excluded at the next rendezvous). Each rank's
  monitor process beats the same counter from its own interpreter, so a rank looks dead only
  when both stop (a TCPStore connect holds the GIL, and its reverse-DNS lookup can stall for
  seconds on some hosts);
* while an attempt is armed: checks the store for a fault report of this attempt, and checks the
  rank's own progress — no :meth:`~.call_wrapper.CallWrapper.ping` for ``soft_timeout`` s is
  reported as a ``hang``;
* on a fault: waits for any :meth:`~.call_wrapper.CallWrapper.atomic` section to end, runs the
  abort policy (unblocks collectives, see :mod:`.interrupt`) and signals the main thread, again
  every ``resend`` s while the main thread is still inside the function.

Heartbeats are counters compared with this thread's own clock, so hosts need no synchronised
clocks.
"""

from __future__ import annotations

import threading
import time

from .interrupt import MainThreadInterrupter
from .state import State
from .store import RestartStore


class MonitorThread(threading.Thread):
    def __init__(self, store: RestartStore, rank: int, peers: list[int], interrupter: MainThreadInterrupter,
                 abort, soft_timeout: float, heartbeat_interval: float, heartbeat_timeout: float,
                 interval: float = 0.01, resend: float = 0.2):
        super().__init__(name=f"nvrx-inprocess-monitor-{rank}", daemon=True)
        self.store, self.rank, self.interrupter, self.abort = store, rank, interrupter, abort
        self.soft_timeout, self.interval, self.resend = soft_timeout, interval, resend
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self.atomic_lock = threading.RLock()
        self.atomic_depth = 0
        """> 0 while the main thread is inside ``atomic()``: no soft timeout there (the hard one still holds)."""
        """Held by the main thread inside ``atomic()``; the monitor interrupts only between sections."""
        self.last_ping = time.monotonic()
        """Monotonic time of the main thread's last progress signal (written by the main thread)."""
        self._lock = threading.Lock()
        self._abort_lock = threading.Lock()
        self._stop_event = threading.Event()
        self._peers = [p for p in peers if p != rank]
        self._beats: dict[int, tuple[int, float]] = {}
        self._stale: set[int] = set()
        self._reported_stale: set[int] = set()
        self._state: State | None = None
        self._hang_reported = False
        self.interrupting = False
        """Set once this attempt is being interrupted; ``atomic()`` refuses to start then."""
        self.detected_at: float | None = None
        """Wall time at which this thread noticed the attempt's fault."""
        self.error: BaseException | None = None

    # -- called by the main thread -----------------------------------------------------------
    def arm(self, state: State) -> None:
        with self._lock:
            self._state = state
            self._peers = [p for p in state.members if p != self.rank]
            self._stale &= set(self._peers)
            self._beats = {p: b for p, b in self._beats.items() if p in self._peers}
            self._reported_stale = set()
            self._hang_reported = False
            self.interrupting = False
            self.detected_at = None
            self.last_ping = time.monotonic()

    def disarm(self) -> None:
        """After this returns no abort is running and none will start (the main thread may now
        close the attempt's sockets without racing a cut on reused fd numbers)."""
        with self._abort_lock, self._lock:
            self._state = None

    def stale(self) -> set[int]:
        with self._lock:
            return set(self._stale)

    def silent_for(self, peer: int) -> float:
        """Seconds since ``peer``'s heartbeat last moved (as seen here; 0 if never tracked)."""
        with self._lock:
            seen = self._beats.get(peer)
        return time.monotonic() - seen[1] if seen else 0.0

    def stop(self, timeout: float = 5.0) -> None:
        self._stop_event.set()
        self.join(timeout)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        next_beat = 0.0
        last_signal = 0.0
        while not self._stop_event.wait(self.interval):
            try:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval
                    self.store.beat(self.rank)
                    self._check_peers(now)
                with self._lock:
                    state = self._state
                if state is None:
                    continue
                if not self.interrupting:
                    if self.store.has_fault(state.iteration):
                        self._interrupt(state)
                        last_signal = time.monotonic()
                    elif (not self._hang_reported and not self.atomic_depth
                          and now - self.last_ping > self.soft_timeout):
                        self._hang_reported = True
                        self.store.report_fault(state.iteration, self.rank, "hang",
                                                f"no ping for {now - self.last_ping:.2f} s "
                                                f"(soft_timeout {self.soft_timeout} s)",
                                                time.time() - (now - self.last_ping))
                elif self.interrupter.armed and now - last_signal > self.resend:
                    self.interrupter.interrupt(self.interrupter.reason)
                    last_signal = now
            except Exception as e:  # the store went away: nothing left to coordinate with
                self.error = e
                if self._stop_event.wait(0.5):
                    return

    def _check_peers(self, now: float) -> None:
        beats = self.store.heartbeats(self._peers)
        with self._lock:
            state = self._state
            for p in self._peers:
                count = beats.get(p, -1)
                seen = self._beats.get(p)
                if seen is None or seen[0] != count:
                    self._beats[p] = (count, now)
                    self._stale.discard(p)
                elif count >= 0 and now - seen[1] > self.heartbeat_timeout:
                    self._stale.add(p)
        if state is not None:
            for p in (self.stale() & set(self._peers)) - self._reported_stale:
                self._reported_stale.add(p)
                self.store.report_fault(state.iteration, p, "dead",
                                        f"no heartbeat for > {self.heartbeat_timeout} s (seen by rank {self.rank})")

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
            faults = self.store.faults(state.iteration)
            reason = "; ".join(f"{f['cause']} on rank {f['rank']}: {f['detail'][:200]}" for f in faults[:3])
            try:
                self.abort(state)
            finally:
                self.interrupter.interrupt(f"attempt {state.iteration} interrupted: {reason}")
