"""Small helpers for processes that meet over loopback: free ports, listening sockets bound to one
address (a ``TCPStore`` server alone listens on every interface), and :func:`wait_for`, the bounded
wait every layer uses instead of a loop of its own."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


PORTS_ENV = "NVRX_LAB_PORTS"
"""``LO-HI``: pick free ports from these only (each of ``make test``'s workers has its own slice)."""


SECRET_ENV = "NVRX_LAB_REPLICA_SECRET"
"""The shared secret of the replica groups' coordinator and ranks (unset or empty: no authentication)."""


def shared_secret() -> bytes | None:
    """This process's shared secret (:data:`SECRET_ENV`), read where a process starts; None: none."""
    return os.environ.get(SECRET_ENV, "").encode() or None


def _pick_range() -> range:
    """The ports :func:`free_ports` picks from: ``$NVRX_LAB_PORTS`` if set, else :func:`port_range`."""
    if not (given := os.environ.get(PORTS_ENV)):
        return port_range()
    try:
        low, high = (int(v) for v in given.split("-"))
    except ValueError:
        low = high = -1
    if not 1024 <= low < high <= 65535:
        raise ValueError(f"${PORTS_ENV}={given!r}: expected LO-HI, two ports 1024..65535 with LO < HI")
    return range(low, high + 1)


def worker_ports(index: int, count: int) -> range:
    """Slice ``index`` of ``count`` equal slices of :func:`port_range` (one per ``make test`` worker)."""
    if not 0 <= index < count:
        raise ValueError(f"worker {index} of {count}: expected 0 <= index < count")
    pool = port_range()
    size = len(pool) // count
    return range(pool.start + index * size, pool.start + (index + 1) * size)


def port_range() -> range:
    """Ports outside the kernel's ephemeral range (``ip_local_port_range``). A port the kernel may hand to an
    outgoing connection can be taken by a client that retries connecting to it before its server listens: Linux
    then connects the client's socket to itself (a TCP self-connect; the client reads its own requests back, and
    the server finds the port in use)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(20000, low) if low - 20000 >= 4096 else range(high + 1, 65536)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1", consecutive: bool = False, tries: int = 200) -> list[int]:
    """``n`` distinct TCP ports free right now on ``host`` and never handed out as ephemeral ports;
    ``consecutive``: ``p, p + 1, ...`` (a store at ``p`` and the wrapper's store at ``p + 1``)."""
    pool, rng = _pick_range(), random.SystemRandom()
    for _ in range(tries):
        if consecutive:
            start = rng.randrange(pool.start, pool.stop - n)
            ports = list(range(start, start + n))
        else:
            ports = rng.sample(pool, n)
        if all(_bindable(host, p) for p in ports):
            return ports
    raise RuntimeError(f"no {n} free ports on {host} in {pool.start}..{pool.stop - 1} after {tries} tries")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (see :func:`free_ports`)."""
    return free_ports(1, host)[0]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are both free (MASTER_PORT and the wrapper's store)."""
    return free_ports(2, host, consecutive=True)[0]


def listen(host: str, port: int = 0, backlog: int = 512) -> socket.socket:
    """A listening TCP socket on the address ``host`` resolves to, never on every interface unless
    ``host`` says so (``0.0.0.0``/``::``). Pass ``sock.detach()`` to ``TCPStore(master_listen_fd=...)``:
    ``127.0.0.1`` keeps a single-node store off the network; a multi-node job names rank 0's address."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port} ({addr[0]}): {e.strerror}") from None
    return sock


def accepting(host: str, port: int) -> bool:
    """Something listens on ``host:port`` (one TCP connect, closed at once)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def wait_for(predicate: Callable[[], T], timeout: float, what: str, *, interval: float | Callable[[], float] = 0.05,
             on_poll: Callable[[], object] | None = None) -> T:
    """The one way to wait in ``nvrx_lab``: poll ``predicate`` every ``interval`` s until it returns
    something truthy, and return that. ``on_poll`` runs after every unsuccessful poll (a heartbeat, a
    progress write). After ``timeout`` s (``float("inf")``: never), ``TimeoutError`` naming ``what``.
    ``predicate`` may raise to stop the wait early (a process it waits on has died). ``interval`` may be
    a callable, asked for each pause after ``on_poll``: a back-off (Kubernetes' CrashLoopBackOff between
    restarts of a pod)."""
    deadline = time.monotonic() + timeout
    pause = interval if callable(interval) else lambda: interval
    while True:
        value = predicate()
        if value:
            return value
        if on_poll is not None:
            on_poll()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(pause())
