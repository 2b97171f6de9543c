"""Liveness: how a long, legitimate wait inside one layer tells a watchdog of another layer "still well".

The in-process restart wrapper counts a rank silent for ``soft_timeout`` as hung. A library call that
blocks on purpose (a checkpointer waiting for its writer process to start, rank 0 waiting for every
rank's post) would look hung to it, and the restart it causes would hide the real state of things.
Such a wait calls :func:`beat` each time it polls; a watchdog that wants to hear it registers with
:func:`listen` for the thread it watches::

    stop = liveness.listen(call_wrapper.ping)    # the wrapper, for the attempt's thread
    ...
    liveness.beat()                               # any layer, inside a bounded wait
    ...
    stop()                                        # the attempt is over

A beat from any other thread than the one a listener watches is ignored (a background thread's wait
says nothing of the training loop). Layers never import each other for this: both import this module.
Only bounded waits beat, so a wait that never ends still ends in its own timeout error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_lock = threading.Lock()
_listeners: dict[int, tuple[int, Callable[[], object]]] = {}
_next = 0


def listen(callback: Callable[[], object], thread: threading.Thread | None = None) -> Callable[[], None]:
    """Call ``callback`` on every :func:`beat` from ``thread`` (default: the calling thread); returns
    the function that stops listening."""
    global _next
    ident = (thread or threading.current_thread()).ident
    with _lock:
        key, _next = _next, _next + 1
        _listeners[key] = (ident, callback)

    def stop() -> None:
        with _lock:
            _listeners.pop(key, None)

    return stop


def beat() -> None:
    """This thread is waiting, well: tell whoever listens to it."""
    ident = threading.get_ident()
    with _lock:
        callbacks = [cb for (who, cb) in _listeners.values() if who == ident]
    for cb in callbacks:
        cb()


__all__ = ["beat", "listen"]
