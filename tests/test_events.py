"""The event stream's writer: one line per emit, no descriptor lost to an in-process interrupt."""

import os
import signal
import threading
import time

from nvrx_lab.observe.events import EventLog, read_events


class Interrupt(BaseException):
    """What the in-process monitor's signal raises in the main thread (there: ``RankShouldRestart``)."""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_interrupts_landing_anywhere_in_emit_leak_no_descriptor(tmp_path):
    """The in-process monitor interrupts the main thread at any bytecode; an emit it lands in must not
    leave a descriptor open (an open per emit did: one fd more after 100 restarts of the soak)."""
    log = EventLog(tmp_path / "events.jsonl", rank=3)
    armed, interrupted, stop = [False], 0, threading.Event()

    def handler(signum, frame):  # raises once per arming, so the test's own loop is never hit
        if armed[0]:
            armed[0] = False
            raise Interrupt

    def storm() -> None:
        while not stop.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
            time.sleep(0.0002)

    previous = signal.signal(signal.SIGUSR2, handler)
    thread = threading.Thread(target=storm, daemon=True)
    before = open_fds()
    thread.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                armed[0] = True
                for i in range(100):
                    log.emit("step", step=i)
                armed[0] = False
            except Interrupt:
                interrupted += 1
    finally:
        armed[0] = False
        stop.set()
        thread.join(5)
        signal.signal(signal.SIGUSR2, previous)
    assert interrupted > 100, f"the storm interrupted only {interrupted} emit loops"
    assert open_fds() == before
    events = read_events(tmp_path / "events.jsonl")
    assert events and all(e["kind"] == "step" and e["rank"] == 3 for e in events)  # whole lines only


def test_a_log_without_a_path_writes_nothing_and_a_closed_log_stops(tmp_path):
    EventLog(None).emit("step", step=1)
    log = EventLog(tmp_path / "sub" / "events.jsonl")
    log.emit("start")
    log.close()
    log.emit("step", step=1)
    log.close()
    assert [e["kind"] for e in read_events(tmp_path / "sub" / "events.jsonl")] == ["start"]
