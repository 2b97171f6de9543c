"""Cutting a process group's sockets: how a collective blocked on a peer that will never answer is ended.

gloo has no working abort for a collective in flight (``ProcessGroupGloo.abort()`` does not wake a pending
``wait``: seen on torch 2.13); shutting its TCP sockets down does, at once, on every rank that cuts or is cut.
The in-process restart layer (:mod:`nvrx_lab.inprocess.interrupt`) cuts this way: it remembers the sockets a group
opened (:func:`socket_fds` before and after it connects) and :func:`shutdown_connected` them. (The replica groups'
data plane, :mod:`nvrx_lab.replicas.group`, never blocks in a collective: it watches each one and abandons it.)
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterable


def socket_fds() -> set[int]:
    """The open file descriptors of this process that are sockets."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.stat(f"/proc/self/fd/{name}").st_mode):
                out.add(int(name))
        except (OSError, ValueError):
            continue
    return out


def shutdown_connected(fds: Iterable[int], shut: bool = True) -> int:
    """``shutdown(SHUT_RDWR)`` every *connected* TCP socket among ``fds``; listeners are skipped.

    The descriptor is duplicated for the call, so the owner's fd number stays valid and is closed
    by its owner later. Returns how many sockets were shut down (``shut=False``: only counted).
    """
    n = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            s.getpeername()  # raises if not connected
            if shut:
                s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()
    return n
