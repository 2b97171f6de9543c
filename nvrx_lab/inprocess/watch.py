"""Waiting for a store key without polling the store
==================================================

The end of an attempt (``it/<n>/end``) and a rendezvous decision (``rdzv/<n>/members``) are each
one key. :class:`KeyWatch` waits for them in a thread of its own, with one blocking
``TCPStore.wait`` per key (its own client: clients are not shared between threads); the rank
polls a local :class:`threading.Event` instead of the store, so it keeps writing its progress
for the hard timeout, and the store sees one operation per key per rank — at 1,024 ranks and a
10 ms poll, polling would cost the store 100,000 operations a second.

Keys are waited for one at a time, in the order asked (every key asked for is set sooner or
later: an attempt ends with ``fault`` or ``done``; a rendezvous is decided or times out).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from .store import RestartStore


@dataclass
class Watched:
    key: str
    timeout: float
    event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    """Set when the wait failed (timed out, or the store went away)."""
    value: str | None = None
    """The key's value, once a reader fetched it (kept so it is read once)."""

    def is_set(self) -> bool:
        return self.event.is_set()


class KeyWatch(threading.Thread):
    def __init__(self, store: RestartStore, name: str = "nvrx-inprocess-watch"):
        super().__init__(name=name, daemon=True)
        self.store = store
        self._queue: queue.Queue[Watched | None] = queue.Queue()

    def watch(self, key: str, timeout: float) -> Watched:
        """Start waiting for ``key`` (at most ``timeout`` s); returns the handle to poll."""
        handle = Watched(key, timeout)
        self._queue.put(handle)
        return handle

    def run(self) -> None:
        while (handle := self._queue.get()) is not None:
            try:
                self.store.wait(handle.key, handle.timeout)
            except BaseException as e:  # DistStoreError: timed out, or the host is gone
                handle.error = e
            handle.event.set()

    def close(self, timeout: float = 2.0) -> None:
        """Stop after the current wait (which ends when its key is set or times out)."""
        self._queue.put(None)
        self.join(timeout)
