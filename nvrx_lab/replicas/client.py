"""A rank's side of the coordinator: one connection, a reader thread, a heartbeat thread.

::

    client = ReplicaClient("coord-host", port, replica=2, rank=0, ranks=1)
    quorum = client.join(step=1, done=None)          # rank 0 of a group; every rank then calls next_quorum()
    ...                                              # the step's reduction, watching client.aborted(quorum.qid)
    quorum = client.join(step=2, done=1)             # finished step 1: it commits once every member has
    client.bye()

The reader thread takes the coordinator's answers (a quorum for each rank of a member), its abort notices (a member
of this quorum failed: :meth:`aborted` turns true, the abort callback ends the reduction at once) and an eviction.

When the connection breaks (the coordinator's process restarted, or its node went silent: the socket's
``TCP_USER_TIMEOUT`` ends a connection whose heartbeats go unacknowledged for :data:`SILENT_S`), the reader reconnects
to the same address with backoff for ``reconnect_timeout``, says ``hello`` again with this rank's
:class:`~.protocol.Position` (a restarted coordinator rebuilds the quorum from them: :mod:`.admission`) and sends
again a ``join`` that was never answered. Training waits at its next quorum meanwhile; only when no coordinator
answers in time does :meth:`next_quorum` raise ``ConnectionError``.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable

from nvrx_lab import liveness
from nvrx_lab.net import shared_secret, wait_for

from .progress import Progress
from .protocol import SECRET_ENV, VERSION, Position, Quorum, encode, proof

RECONNECT_S = 600.0
"""How long a rank tries to reach a restarted coordinator by default (``--replica-reconnect-timeout``)."""
BEAT_S = 0.5  # between two heartbeats: a silent node is noticed within the coordinator's --beat-timeout
CHALLENGE_S = 10.0
"""How long a rank with a shared secret waits for the coordinator's challenge (sent on accept: milliseconds)."""
SILENT_S = 10
"""Seconds of unacknowledged heartbeats before a connection is dead: a silent node in seconds, not TCP's ~15 min."""

EVICTED_EXIT = 3
"""Exit code of a replica the coordinator dropped as hung (its launcher starts a replacement)."""


class JobFinished(Exception):
    """The other replicas trained the last step before this one joined: nothing left to do."""

    def __init__(self, step: int | None):
        super().__init__(f"the job finished at step {step} before this replica joined")
        self.step = step


class Refused(RuntimeError):
    """The coordinator refused this group: another protocol version (another nvrx_lab), or a model whose gradients
    cannot be summed with the others' (another layout). A usage error: no restart mends it."""


class StateLost(RuntimeError):
    """The coordinator ended the job: every replica group failed before a replacement healed (the state is gone), or
    fewer than ``--min-replicas`` groups came within the first quorum's timeout. The message says which."""


class ReplicaClient:
    def __init__(self, host: str, port: int, replica: int, rank: int, ranks: int, connect_timeout: float = 600.0,
                 reconnect_timeout: float = RECONNECT_S, stored: bool = False):
        self.replica, self.rank, self.ranks = replica, rank, ranks
        self.address, self.reconnect_timeout = (host, port), reconnect_timeout
        self.incarnation = uuid.uuid4().hex[:12]
        self.position = Position(stored=stored)
        """Where this rank stands (its trainer updates ``committed``): a restarted coordinator rebuilds from it."""
        self.reconnects = 0
        self._join: tuple[dict, socket.socket] | None = None  # the join not yet answered, and the connection it went on
        self._layout: dict | None = None  # the gradients' layout, which the first join to each coordinator carries
        self._layout_due = False
        self.sock = wait_for(lambda: _connect(host, port), connect_timeout, f"the coordinator at {host}:{port}",
                             interval=0.2)
        self._send_lock = threading.Lock()
        self._quorums: queue.Queue = queue.Queue()
        self._welcome = threading.Event()
        self.store_port = 0
        self.healing = False
        self._aborted: set[int] = set()
        self.on_abort: Callable[[int], None] | None = None
        """Called from the reader thread when a quorum is aborted (its qid): cut the reduction's sockets."""
        self.closed = False
        self.progress: Progress | None = None
        """This rank's unit counter (:mod:`.progress`), which answers the coordinator's probe; set it before training."""
        self._refused: str | None = None
        self._secret = shared_secret()  # $NVRX_LAB_REPLICA_SECRET
        self._hello(self._challenge(self.sock))
        threading.Thread(target=self._read, daemon=True, name="nvrx-replica-reader").start()
        wait_for(self._welcome.is_set, connect_timeout, "the coordinator's welcome", interval=0.01, on_poll=liveness.beat)
        if self._refused is not None:
            self.closed = True
            self.sock.close()
            raise Refused(self._refused)
        threading.Thread(target=self._beat, args=(BEAT_S,), daemon=True, name="nvrx-replica-beat").start()

    def _send(self, message: dict) -> None:
        with self._send_lock:
            self.sock.sendall(encode(message))

    def _challenge(self, sock: socket.socket) -> str | None:
        """With a shared secret: the nonce the coordinator opens with (its first line); a coordinator without is refused."""
        if self._secret is None:
            return None
        line = b""
        sock.settimeout(CHALLENGE_S)
        try:
            while not line.endswith(b"\n") and (byte := sock.recv(1)):
                line += byte
            msg = json.loads(line) if line.endswith(b"\n") else {}
        except (OSError, ValueError):
            msg = {}
        finally:
            sock.settimeout(None)  # blocking again, as _connect made it
        if msg.get("op") != "challenge":
            host, port = self.address
            raise Refused(f"the coordinator at {host}:{port} asks for no shared secret and this rank has one "
                          f"(${SECRET_ENV}): set the same one on the coordinator")
        return msg["nonce"]

    def _hello(self, nonce: str | None) -> None:
        self._send({"op": "hello", "version": VERSION, "replica": self.replica, "rank": self.rank, "ranks": self.ranks,
                    "incarnation": self.incarnation, **self.position.hello(),
                    **({"auth": proof(self._secret, nonce)} if nonce is not None else {})})

    def _read(self) -> None:
        while True:
            try:
                for line in self.sock.makefile("rb"):
                    self._dispatch(json.loads(line))
            except (OSError, ValueError):
                pass
            if self.closed or not self._reconnect():
                break
        if not self.closed:  # no coordinator answers: nothing can commit any more
            self._quorums.put(None)

    def _reconnect(self) -> bool:
        """The connection broke: reach a coordinator at the same address again (a restarted one), say hello with this
        rank's position, and send again the join it never answered. False: none answered in time."""
        host, port = self.address
        print(f"[nvrx_lab.replicas] replica {self.replica} rank {self.rank}: lost the coordinator at {host}:{port}; "
              f"reconnecting for up to {self.reconnect_timeout:g} s (at committed step {self.position.committed})",
              file=sys.stderr, flush=True)
        self.sock.close()
        deadline, delay, sock = time.monotonic() + self.reconnect_timeout, 0.05, None
        while not self.closed and (sock := _connect(host, port)) is None and time.monotonic() < deadline:
            threading.Event().wait(delay)  # a backoff between attempts, not a wait for an event
            delay = min(2 * delay, 1.0)
        if sock is None:
            if not self.closed:  # (closed: this rank said bye meanwhile)
                print(f"[nvrx_lab.replicas] replica {self.replica} rank {self.rank}: no coordinator at {host}:{port} "
                      f"within {self.reconnect_timeout:g} s", file=sys.stderr, flush=True)
            return False
        with self._send_lock:
            self.sock = sock
            self.reconnects += 1
            self._layout_due = self._layout is not None
        try:
            self._hello(self._challenge(sock))
            with self._send_lock:
                if self._join is not None and self._join[1] is not sock:
                    message = {**self._join[0], **({"layout": self._layout} if self._layout_due else {})}
                    sock.sendall(encode(message))
                    self._join, self._layout_due = (message, sock), False
        except OSError:
            pass  # broke again at once: the next read fails and reconnects
        except Refused as e:  # the restarted coordinator has no secret: a usage error, which no reconnect mends
            self._dispatch({"op": "refused", "why": str(e)})
        if self.on_abort is not None and self.position.qid:  # the dead coordinator's quorum: a reduction still waiting
            self._aborted.add(self.position.qid)             # in it (a member that never heard it) is cut, and the
            self.on_abort(self.position.qid)                 # restarted coordinator's first quorum redoes the step
        return True

    def _dispatch(self, msg: dict) -> None:
        op = msg["op"]
        if op == "welcome":
            self.store_port, self.healing = msg["store_port"], msg["healing"]
            self._welcome.set()
        elif op == "refused":  # at the hello (another protocol), or the first join (another model: see .coordinator)
            self._refused = msg["why"]
            self.closed = True
            self._welcome.set()
            self._quorums.put(Refused(msg["why"]))
        elif op == "quorum":
            with self._send_lock:
                self._join = None
            self.position.qid = msg["qid"]
            self._quorums.put(Quorum.from_dict(msg))
        elif op == "abort":
            self._aborted.add(msg["qid"])
            print(f"[nvrx_lab.replicas] replica {self.replica} rank {self.rank}: step aborted ({msg['why']})",
                  file=sys.stderr, flush=True)
            if self.on_abort is not None:
                self.on_abort(msg["qid"])
        elif op == "probe":  # hung or only slow? the units of work the device completed (.probe)
            report = self.progress.report() if self.progress is not None else {"working": False}
            self._send({"op": "progress", "id": msg["id"], "rank": self.rank, **report})
        elif op == "state_lost":
            self.closed = True
            self._quorums.put(StateLost(msg["why"]))
        elif op == "finished":  # the job ended before this replica could join
            self.closed = True
            self._quorums.put(msg["step"])
        elif op == "evict":
            print(f"[nvrx_lab.replicas] replica {self.replica} rank {self.rank} dropped by the coordinator "
                  f"({msg['why']}): exiting for a replacement", file=sys.stderr, flush=True)
            os._exit(EVICTED_EXIT)

    def _beat(self, every: float) -> None:
        while not self.closed:  # a periodic sender, not a wait
            try:
                self._send({"op": "beat"})
            except OSError:
                pass  # the reader reconnects (or gives up, and this rank fails)
            threading.Event().wait(every)

    def aborted(self, qid: int) -> bool:
        return qid in self._aborted

    def join(self, step: int, done: int | None, layout: dict | None = None) -> None:
        """Rank 0 of a group: ready for ``step``, and the group finished step ``done`` (None: it did not); its first
        join carries the gradients' ``layout`` (:func:`layout`), which the coordinator checks against the others'.
        Sent again after a reconnect until a quorum answers it (a restarted coordinator checks the layout too)."""
        message = {"op": "join", "step": step, "done": done}
        with self._send_lock:
            if layout is not None or self._layout_due:  # the first join, and the first to a restarted coordinator
                self._layout = message["layout"] = layout or self._layout
                self._layout_due = False
            self._join = (message, self.sock)
            try:
                self.sock.sendall(encode(message))
            except OSError:
                pass  # the reader reconnects and sends it

    def next_quorum(self, timeout: float = 3600.0) -> Quorum:
        """The coordinator's next quorum for this replica (every rank gets it); waiting is progress."""
        got: list = []

        def arrived() -> bool:
            try:
                got.append(self._quorums.get(timeout=0.05))
                return True
            except queue.Empty:
                return False

        wait_for(arrived, timeout, f"replica {self.replica}'s next quorum", interval=0.0, on_poll=liveness.beat)
        if got[0] is None:
            raise ConnectionError("the coordinator closed the connection")
        if isinstance(got[0], StateLost | Refused):
            raise got[0]
        if not isinstance(got[0], Quorum):
            raise JobFinished(got[0])
        return got[0]

    def stuck(self, step: int, qid: int) -> None:
        try:
            self._send({"op": "stuck", "step": step, "qid": qid})
        except OSError:
            pass  # no coordinator now: the reduction's own timeout bounds the wait

    def fail(self, why: str) -> None:
        """This rank failed (an error it will exit with): the coordinator drops its replica at once."""
        try:
            self._send({"op": "fail", "why": why[:200]})
        except OSError:
            pass

    def bye(self) -> None:
        self.closed = True
        try:
            self._send({"op": "bye"})
            self.sock.close()
        except OSError:
            pass


def _connect(host: str, port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except OSError:
        return None
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: unacknowledged data for SILENT_S ends the connection
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, SILENT_S * 1000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # and probes while nothing is sent
    for opt, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", SILENT_S - 2)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    return sock
