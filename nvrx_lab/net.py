"""Small helpers for processes that meet over loopback: free ports, listening sockets bound to one
address (a ``TCPStore`` server alone listens on every interface), and :func:`wait_for`, the bounded
wait every layer uses instead of a loop of its own."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports; for a store at ``port`` and a wrapper store at ``port + 1`` use
    :func:`free_port_pair` instead."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_pair(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are both free (MASTER_PORT and the wrapper's store)."""
    for _ in range(tries):
        p = free_port(host)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no two consecutive free ports on {host} after {tries} tries")


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


def wait_for(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05,
             on_poll: Callable[[], object] | None = None) -> T:
    """The one way to wait in ``nvrx_lab``: poll ``predicate`` every ``interval`` s until it returns
    something truthy, and return that. ``on_poll`` runs after every unsuccessful poll (a heartbeat, a
    progress write). After ``timeout`` s (``float("inf")``: never), ``TimeoutError`` naming ``what``.
    ``predicate`` may raise to stop the wait early (a process it waits on has died)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if on_poll is not None:
            on_poll()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(interval)
