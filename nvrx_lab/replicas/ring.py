"""The cross-replica data plane: plain TCP between the members, a ring per quorum, nothing that a failure wedges.

Every rank listens once (:class:`Endpoint`) and writes its address to the coordinator's store once
(``ep/<replica>/<rank>``). A quorum's ring (:class:`Ring`) is two connections a rank: it connects to the next
member's endpoint and takes the connection the previous member opened to its own, both tagged with the quorum's
id, so a new quorum costs each rank one ``connect`` and no store round trip for the others (gloo's full mesh took
10-30 ms a quorum here: its connection loop wakes every 10 ms). A sum over the ring is the bandwidth-optimal
reduce-scatter then all-gather; a point-to-point connection carries a replacement's state (:mod:`.heal`).

A failure ends every wait at once: a member that dies closes its sockets (the kernel does, as its process exits),
and :meth:`Ring.cut` shuts this rank's own (the coordinator said a member hangs). The next quorum connects anew,
so nothing half-sent ever reaches another step.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from nvrx_lab.net import listen, wait_for

RING, HEAL = 0, 1
CHUNK = 1 << 20  # bytes a send or receive moves at most, between looks at the other socket
TICK_S = 0.002  # while nothing moves: how often the caller looks at its clock (patience) and the coordinator's word
_TAG = struct.Struct("!qii")  # qid, kind (RING or HEAL), the sender's index in the quorum


class RingBroken(RuntimeError):
    """A connection of the ring closed or was cut: a member failed."""


class Endpoint:
    """This rank's listener; the connections other members open to it, filed by (qid, kind, sender index)."""

    def __init__(self, host: str, store: dist.Store, replica: int, rank: int):
        self.sock = listen(host, 0)
        self._inbox: dict[tuple[int, int, int], socket.socket] = {}
        self._cv = threading.Condition()
        threading.Thread(target=self._accept, daemon=True, name="nvrx-replica-endpoint").start()
        self.store = store
        store.set(f"ep/{replica}/{rank}", f"{host}:{self.sock.getsockname()[1]}")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._file, args=(conn,), daemon=True).start()

    def _file(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            tag = _TAG.unpack(recv_exact(conn, bytearray(_TAG.size)))
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, RingBroken, struct.error):
            conn.close()
            return
        with self._cv:
            self._inbox[tag] = conn
            self._cv.notify_all()

    def take(self, qid: int, kind: int, sender: int, cancelled, timeout: float) -> socket.socket:
        """The connection ``sender`` opened for quorum ``qid``; :class:`RingBroken` if ``cancelled()`` turns true or
        ``timeout`` s pass first. Connections of older quorums still waiting here are closed."""
        with self._cv:
            ok = self._cv.wait_for(lambda: (qid, kind, sender) in self._inbox or cancelled(), timeout)
            for key in [k for k in self._inbox if k[0] < qid]:
                self._inbox.pop(key).close()
            if not ok or cancelled():
                raise RingBroken(f"quorum {qid}: member {sender} did not connect")
            return self._inbox.pop((qid, kind, sender))

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def connect(self, replica: int, rank: int, qid: int, kind: int, me: int, timeout: float,
                cancelled: Callable[[], bool] = lambda: False) -> socket.socket:
        """A connection to rank ``rank`` of ``replica``, tagged (qid, kind, this rank's index ``me``). Tried in short
        attempts, so ``cancelled()`` (a cut) ends it even when that rank's node is gone without a reset."""
        key, deadline = f"ep/{replica}/{rank}", time.monotonic() + timeout
        try:
            wait_for(lambda: cancelled() or self.store.check([key]), timeout, f"replica {replica} rank {rank}'s address",
                     interval=0.005)
        except TimeoutError as e:
            raise RingBroken(f"quorum {qid}: {e}") from None
        address = self.store.get(key).decode() if not cancelled() else "?"
        host, port = address.rsplit(":", 1) if ":" in address else ("", "0")
        while not cancelled():
            try:
                conn = socket.create_connection((host, int(port)), timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(_TAG.pack(qid, kind, me))
                return conn
            except TimeoutError:
                if time.monotonic() < deadline:
                    continue
                raise RingBroken(f"quorum {qid}: replica {replica} rank {rank} at {address} did not answer") from None
            except OSError as e:
                raise RingBroken(f"quorum {qid}: cannot reach replica {replica} rank {rank} at {address} ({e})") from None
        raise RingBroken(f"quorum {qid} aborted")


def open_store(host: str, port: int, timeout: float = 60.0) -> dist.TCPStore:
    """The coordinator's store, once per rank: the members' address book."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


class Ring:
    """Quorum ``qid``'s ring among ``members`` (replica ids, sorted), rank ``rank`` of each; this rank is ``index``."""

    def __init__(self, endpoint: Endpoint, qid: int, members: tuple[int, ...], index: int, rank: int):
        self.endpoint, self.qid, self.members, self.index, self.rank = endpoint, qid, members, index, rank
        self.size = len(members)
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self.cut_done = False
        self.out: socket.socket | None = None
        self.inn: socket.socket | None = None

    def connect(self, timeout: float = 60.0) -> Ring:
        if self.size > 1:
            nxt = self.members[(self.index + 1) % self.size]
            self.out = self._keep(self.endpoint.connect(nxt, self.rank, self.qid, RING, self.index, timeout,
                                                        lambda: self.cut_done))
            self.inn = self._keep(self.endpoint.take(self.qid, RING, (self.index - 1) % self.size,
                                                     lambda: self.cut_done, timeout))
            for conn in (self.out, self.inn):
                conn.setblocking(False)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        return self

    def _keep(self, conn: socket.socket) -> socket.socket:
        with self._lock:
            self._socks.append(conn)
            if self.cut_done:  # cut while connecting
                _shut(conn)
                raise RingBroken(f"quorum {self.qid} aborted")
        return conn

    def cut(self) -> None:
        """From any thread: end every transfer of this ring now (its members meet again in the next quorum's)."""
        with self._lock:
            self.cut_done = True
            for conn in self._socks:
                _shut(conn)
        self.endpoint.wake()

    def close(self) -> None:
        self.cut()
        with self._lock:
            for conn in self._socks:
                conn.close()
            self._socks.clear()

    def all_reduce(self, flat: torch.Tensor, tick: Callable[[], None] = lambda: None) -> None:
        """Sum ``flat`` (a contiguous CPU tensor, the same size on every member) over the ring, in place; ``tick`` is
        called between transfers and while nothing moves (it may raise to stop)."""
        n, i = self.size, self.index
        if n == 1:
            return
        chunks = list(torch.tensor_split(flat, n))
        scratch = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype)
        for s in range(n - 1):  # reduce-scatter: then this rank holds the whole sum of chunk i + 1
            incoming = chunks[(i - s - 1) % n]
            got = scratch[:incoming.numel()]
            self._exchange(chunks[(i - s) % n], got, tick)
            incoming.add_(got)
        for s in range(n - 1):  # all-gather: each sum goes round the ring
            self._exchange(chunks[(i + 1 - s) % n], chunks[(i - s) % n], tick)

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor, tick: Callable[[], None]) -> None:
        """Send to the next member while receiving from the previous one: one thread, both sockets non-blocking,
        each moved as far as it can whenever it is ready (neither side ever waits on a full buffer of the other)."""
        out, inn = _bytes(send), _bytes(recv)
        sent = got = 0
        while sent < len(out) or got < len(inn):
            try:
                readable, writable, _ = select.select([self.inn] if got < len(inn) else [],
                                                      [self.out] if sent < len(out) else [], [], TICK_S)
                if not readable and not writable:
                    tick()
                if writable:
                    sent += self.out.send(out[sent:sent + CHUNK])
                if readable:
                    n = self.inn.recv_into(inn[got:], min(CHUNK, len(inn) - got))
                    if n == 0:
                        raise RingBroken(f"quorum {self.qid} aborted" if self.cut_done else
                                         f"quorum {self.qid}: the member before this one closed its connection (it failed)")
                    got += n
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError) as e:  # ValueError: select on a socket another thread closed
                raise RingBroken(f"quorum {self.qid}: {e}") from None
            if self.cut_done:
                raise RingBroken(f"quorum {self.qid} aborted")
        tick()

    def send_to(self, index: int, parts: list[bytes | memoryview], timeout: float = 60.0) -> None:
        """Point to point, for a heal: ``parts`` to member ``index`` over a connection of their own."""
        conn = self._keep(self.endpoint.connect(self.members[index], self.rank, self.qid, HEAL, self.index, timeout,
                                                lambda: self.cut_done))
        try:
            for part in parts:
                conn.sendall(part)
        except OSError as e:
            raise RingBroken(f"quorum {self.qid}: sending to member {index}: {e}") from None

    def recv_from(self, index: int, timeout: float = 60.0) -> socket.socket:
        """The connection member ``index`` opened to send this rank something (read it with :func:`recv_exact`)."""
        return self._keep(self.endpoint.take(self.qid, HEAL, index, lambda: self.cut_done, timeout))


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def recv_exact(conn: socket.socket, buf) -> bytes | bytearray | memoryview:
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        try:
            n = conn.recv_into(view[got:])
        except OSError as e:
            raise RingBroken(str(e)) from None
        if n == 0:
            raise RingBroken("the member closed its connection (it failed)")
        got += n
    return buf


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
