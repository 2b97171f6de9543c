"""Two read timeouts for the rendezvous store, and a rejoin when the node that hosts it is replaced.

The c10d rendezvous store lives in one launcher (on EKS completion index 0's). Its clients' ``read_timeout`` serves
two cases that want opposite values:

* **a first start** — pods pull a ~28 GB image minutes apart, so a client dials a store that is not up yet: long
  (the rendered 600 s);
* **the host replaced** — once a rendezvous has completed, a store call that does not answer means its node is gone
  (a lost node sends no reset: the call waits the whole timeout). Sixteen launchers waiting 600 s idle 128 GPUs for
  ten minutes: short (``rejoin_read_timeout`` in ``--rdzv-conf``, rendered 60 s).

:func:`shorten_after_rendezvous` sets the short timeout on the store once the first rendezvous completed (the round's
``PrefixStore`` passes ``set_timeout`` to the backend's store). When a launcher that does not host the store loses it
(:func:`store_lost`), it waits for the replacement's store to accept connections (:func:`wait_for_store`, bounded by
the first-start timeout), makes a new rendezvous handler and rejoins, its pod alive: on an Indexed Job a failed pod
costs the Job controller's back-off and a retry of ``backoffLimit``, for every one of the other fifteen.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from nvrx_lab.net import wait_for

REJOIN_KEY = "rejoin_read_timeout"
"""The ``--rdzv-conf`` key (seconds): the store's read timeout once a rendezvous has completed."""


def rejoin_timeout(config: dict) -> float | None:
    """``rejoin_read_timeout`` of the rendezvous configuration, or None when it is not set."""
    value = config.get(REJOIN_KEY)
    return None if value in (None, "") else float(value)


def shorten_after_rendezvous(handler, seconds: float) -> None:
    """After each completed rendezvous of ``handler``, its store's read timeout becomes ``seconds``."""
    inner = handler.next_rendezvous

    def next_rendezvous():
        info = inner()
        info.store.set_timeout(timedelta(seconds=seconds))
        return info

    handler.next_rendezvous = next_rendezvous


def store_lost(error: BaseException) -> bool:
    """Whether ``error`` (from torch's agent) says the rendezvous store stopped answering: torch's
    ``RendezvousConnectionError``, or a store call that failed or timed out (``DistError``)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    return isinstance(error, (RendezvousConnectionError, DistError))


def endpoint_of(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    return host, int(port) if port else default_port


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def wait_for_store(endpoint: str, timeout_s: float, interval_s: float = 0.5) -> float:
    """Seconds until the store at ``endpoint`` (``host:port``) accepts a connection; ``TimeoutError`` naming it after
    ``timeout_s``. The connection is closed at once: torch's handler makes its own."""
    host, port = endpoint_of(endpoint)
    t0 = time.monotonic()
    wait_for(lambda: _answers(host, port), timeout_s, f"the rendezvous store at {host}:{port}", interval=interval_s)
    return time.monotonic() - t0
