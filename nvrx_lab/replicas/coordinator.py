"""The coordinator: one small server that forms a quorum per step and says when a member failed.

``python -m nvrx_lab.replicas.coordinator --port P --replicas R`` (a StatefulSet of one behind a Service on EKS). Every
rank of every replica group holds one TCP connection to it (:mod:`.client`); group rank 0 joins once a step. Per
step and replica: one request and one answer (O(1)); per fault: one notice to every rank. It decides:

* **a quorum** for step ``s`` once every live member of the last one has joined ``s``. If they all finished the
  step before, it is committed (every member applies its update: no update is ever applied half-way); replacements
  that said hello meanwhile join a fresh step, with a donor that sends them its state;
* **a member failed** when one of its ranks' connections closes (its process died: at once), its heartbeats stop
  (its node is gone), or every other member waits for it in the step's reduction and its work makes no progress
  (``stuck``, then :mod:`.probe`). The member is dropped (a hung one is told to exit), the others are told to abort
  the step's reduction, and they redo that step without it, taking its rows of the batch (:class:`~.protocol.StepShares`).
Its socket side, and the ``TCPStore`` where every quorum's process group meets (:mod:`.group`): :mod:`.server`."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

from .admission import Admission, Member
from .probe import Probes
from .protocol import Quorum, auth_mismatch, encode, layout_mismatch, version_mismatch
from .server import serve

FIRST_QUORUM_TIMEOUT_S = 600.0  # as torch's rendezvous: a p5 pod may pull a ~28 GB image for minutes


class Coordinator:
    """The coordinator's state and decisions (:meth:`serve` runs it on a socket)."""

    def __init__(self, replicas: int, min_replicas: int = 1, beat_timeout: float = 5.0, emit=None,
                 first_quorum_timeout: float = FIRST_QUORUM_TIMEOUT_S, secret: bytes | None = None,
                 await_replacements: bool = False):
        self.secret = secret  # the shared secret every hello must prove (None: none)
        self.expected, self.min_replicas, self.beat_timeout = replicas, min_replicas, beat_timeout
        self.admission = Admission(replicas, min_replicas, first_quorum_timeout,  # the first quorum (.admission)
                                   awaits=await_replacements)  # and, with it, the last step's wait for replacements
        self.emit = emit or (lambda kind, **f: None)
        self.members: dict[int, Member] = {}
        self.quorum: Quorum | None = None
        self.aborted = False
        self.committed: int | None = None
        self.over = False  # every member trained the last step
        self.state_lost: str | None = None  # why the job cannot go on: every member failed before a replacement healed
        self.stored = False  # a group saves storage checkpoints: losing every group is a resume from the newest
        self.layout: tuple[int, dict] | None = None  # (the replica that set it, the gradients' layout every group must have)
        self.lock = threading.RLock()
        self.store_port = 0
        self._send_locks: dict[socket.socket, threading.Lock] = {}
        self._qid = 0
        self._formed_at = time.monotonic()
        self._unjoined: set[int] = set()  # members of the current quorum that have not joined the next step
        self.probes = Probes(self)

    def hello(self, conn: socket.socket, msg: dict, nonce: str | None = None) -> bool:
        """A rank introduces itself (first, or again after this coordinator restarted: :mod:`.admission`); False:
        refused (another protocol version), and told why. A new process for a rank of a live group means the old one
        was replaced behind the coordinator's back (a node lost before its heartbeats timed out): the old group is
        dropped first, and told to exit if it still listens, so a zombie never trains beside its replacement."""
        if (why := version_mismatch(msg) or auth_mismatch(self.secret, nonce, msg)) is not None:
            print(f"[nvrx_lab.replicas] error: {why}", file=sys.stderr, flush=True)
            self._send(conn, {"op": "refused", "why": why})
            return False
        with self.lock:
            r, rank, who = msg["replica"], msg["rank"], msg.get("incarnation", "")
            m = self.members.get(r)
            if m is not None and m.alive and m.incarnation.get(rank, who) != who:
                self._fail(m, f"rank {rank} is another process now (replaced)", evict=True)
            if m is None or not m.alive:  # a new replica, or the replacement of a failed one
                m = self.members[r] = Member(r, msg["ranks"], healing=self.quorum is not None)
            self.admission.hello(msg)
            self.stored = self.stored or bool(msg.get("stored"))
            m.conns[rank], m.committed[rank], m.incarnation[rank] = conn, msg.get("committed"), who
            self._send(conn, {"op": "welcome", "store_port": self.store_port, "healing": m.healing})
            if self.state_lost or self.over:  # the job cannot go on, or a replacement came after the last step
                m.alive = False
                self._send(conn, {"op": "state_lost", "why": self.state_lost} if self.state_lost else
                           {"op": "finished", "step": self.committed})
                return True
            self._form()
        return True

    def join(self, replica: int, step: int, done: int | None, layout: dict | None = None) -> None:
        with self.lock:
            m = self.members[replica]
            if layout is not None and not self._same_layout(m, layout):
                return
            m.joined, m.stuck = step, False
            if done is not None:
                m.done = done
            self._unjoined.discard(replica)
            if not self._unjoined or self.aborted:  # while members of the quorum still compute: nothing to decide
                self._form()

    def _same_layout(self, m: Member, layout: dict) -> bool:
        """A group's first join carries its gradients' layout: the first one sets it, one that differs is refused (its
        sums would be garbage, or wedge on a size mismatch) and told which settings differ."""
        if self.layout is None:
            self.layout, self.admission.last_step = (m.replica, layout), layout.get("steps")
        if (why := layout_mismatch(m.replica, layout, *self.layout)) is None:
            return True
        print(f"[nvrx_lab.replicas] error: {why}", file=sys.stderr, flush=True)
        m.alive = False
        for conn in m.conns.values():
            self._send(conn, {"op": "refused", "why": why})
        return False

    def beat(self, replica: int) -> None:
        if (m := self.members.get(replica)) is not None: m.last_beat = time.monotonic()  # noqa: E701 (a float store)

    def bye(self, replica: int) -> None:
        """The replica trained its last step and leaves: no failure."""
        with self.lock:
            if (m := self.members.get(replica)) is not None:
                m.alive, m.finished = False, True
            if self.members and all(m.finished or m.healing for m in self.members.values() if m.alive or m.finished):
                self.over = True
                for w in self.members.values():  # the job is over: replacements still waiting to join have nothing to do
                    if w.alive:
                        w.alive = False
                        for conn in w.conns.values():
                            self._send(conn, {"op": "finished", "step": self.committed})

    def lost(self, replica: int, conn: socket.socket, why: str = "its process exited (connection closed)",
             evict: bool = True) -> None:
        """A rank's connection closed without a ``bye`` (its process is gone, or only the connection broke: its group's
        other ranks are told to exit for a replacement), or the rank said it failed (``evict=False``)."""
        with self.lock:
            m = self.members.get(replica)
            if m is not None and m.alive and any(c is conn for c in m.conns.values()):
                self._fail(m, why, evict=evict)

    def gone(self, replica: int) -> None:
        """The group's launcher exited (said by it): no replacement of that group comes, nobody waits for one."""
        with self.lock:
            if replica not in self.admission.gone:
                self.admission.gone.add(replica)
                self._form()

    def check_beats(self) -> None:
        with self.lock:
            now = time.monotonic()
            for m in list(self.members.values()):
                if m.alive and now - m.last_beat > self.beat_timeout:
                    self._fail(m, f"no heartbeat for {now - m.last_beat:.1f} s (its node is gone?)", evict=True)

    def _fail(self, m: Member, why: str, evict: bool = False) -> None:
        m.alive = False
        self.emit("replica_lost", replica=m.replica, why=why, qid=self.quorum.qid if self.quorum else None)
        print(f"[nvrx_lab.replicas] replica {m.replica} dropped: {why}", file=sys.stderr, flush=True)
        if evict:
            for conn in m.conns.values():
                self._send(conn, {"op": "evict", "why": why})
        if self.quorum is not None and m.replica in self.quorum.members and not self.aborted:
            self.aborted = True
            notice = {"op": "abort", "qid": self.quorum.qid, "why": f"replica {m.replica}: {why}"}
            for other in self.members.values():
                if other.alive:
                    for conn in other.conns.values():
                        self._send(conn, notice)
        self._form()

    def _form(self) -> None:
        """Form the next quorum if every live member is ready for it."""
        q = self.quorum
        alive = {r: m for r, m in self.members.items() if m.alive and len(m.conns) == m.ranks}
        if q is None:  # the first quorum: every group, or enough once it is due (.admission)
            if (first := self.admission.plan(self.members)) is not None:
                self._qid = max(self._qid, self.admission.top_qid)
                self._publish(first.members, first.step, first.committed, first.joiners, resumed=first.resumed)
            return
        live = [r for r in q.members if r in alive and not alive[r].healing]  # (not a replacement that said hello)
        if not live and not self.over and not any(m.alive and not m.healing for m in self.members.values()):
            self._lose_state(q)
            return
        if not live:
            return
        finished = all(alive[r].joined == q.step + 1 and alive[r].done == q.step for r in live)
        if not finished:  # aborted, or a sum failed without a word: the step again in a fresh group, without the lost
            if all(alive[r].joined in (q.step, q.step + 1) for r in live):  # (the survivors keep what they computed)
                self._publish(live, step=q.step, committed=None, fresh=True)
            return
        if finished:  # (a member lost after the reduction completed everywhere: its part is in the sum, commit)
            joiners = sorted(r for r, m in alive.items() if m.healing and m.joined is not None and r not in live)
            if len(live) + len(joiners) >= self.min_replicas and not self.admission.holds(q.step + 1, self.members):
                self._publish(sorted(live + joiners), step=q.step + 1, committed=q.step, joiners=joiners)  # else: wait

    def check_first_quorum(self) -> None:
        """Past ``first_quorum_timeout`` without a first quorum: start with the groups that came if they are at least
        ``min_replicas`` (the others join later and heal from them), else end the job; one line either way."""
        with self.lock:
            adm = self.admission
            if self.quorum is not None or self.state_lost or not adm.overdue():
                return
            came, waited = (adm.connected if adm.resuming else adm.ready)(self.members), adm.waited()
            missing = sorted(set(range(self.expected)) - set(came))
            self.emit("first_quorum_due", came=came, missing=missing, waited_s=round(waited, 3), resumed=adm.resuming)
            if len(came) < self.min_replicas:
                self._end(f"only {len(came)} of the {self.expected} replica groups ({came}) joined within {waited:.0f} s "
                          f"({adm.timeout_flag()}), fewer than --min-replicas {self.min_replicas}; groups {missing} "
                          f"never came (a pod still pending? kubectl describe pod)")
                return
            print(f"[nvrx_lab.replicas] the first quorum starts with replica groups {came} of {self.expected}: {missing} "
                  f"did not join within {waited:.0f} s ({adm.timeout_flag()}); they join later and heal from a live "
                  f"group", file=sys.stderr, flush=True)
            self._form()

    def _lose_state(self, q: Quorum) -> None:
        """Every member of the last quorum failed and nobody else holds the state: with storage checkpoints the job
        goes on from the newest (the groups' next processes restore it and found a first quorum again; a replacement
        waiting to heal is told to exit, for one that restores), else it ends, loudly."""
        if self.state_lost:
            return
        if self.stored:
            self.emit("from_storage", step=q.step, committed=self.committed)
            print(f"[nvrx_lab.replicas] every replica group failed by step {q.step} (last committed step "
                  f"{self.committed}): the job goes on from the newest storage checkpoint, which each group's next "
                  "process restores", file=sys.stderr, flush=True)
            for m in self.members.values():
                if m.alive:
                    m.alive = False
                    for conn in m.conns.values():
                        self._send(conn, {"op": "evict", "why": "the job goes on from the storage checkpoint"})
            self.quorum, self.admission = None, self.admission.again()
            return
        self.emit("state_lost", step=q.step, committed=self.committed)
        self._end(f"every replica group failed by step {q.step} before a replacement could take a live "
                  f"replica's state (last committed step {self.committed}); nothing is left to heal from")

    def _end(self, why: str) -> None:
        """The job cannot go on: every rank connected is told why (it exits 1 with that line), and so is any later."""
        if self.state_lost:
            return
        self.state_lost = why
        print(f"[nvrx_lab.replicas] error: {why}", file=sys.stderr, flush=True)
        for m in self.members.values():
            if m.alive:
                m.alive = False
                for conn in m.conns.values():
                    self._send(conn, {"op": "state_lost", "why": self.state_lost})

    def _publish(self, members: list[int], step: int, committed: int | None, joiners: list[int] = (),
                 fresh: bool = False, resumed: bool = False) -> None:
        prev = self.quorum
        self._qid += prev is None or fresh or tuple(members) != prev.members
        now = time.monotonic()
        epoch = {"formed_s": round(now - self._formed_at, 6), "lost": sorted(set(prev.members) - set(members)) if prev else []}
        donor = next((r for r in members if r not in joiners), None) if joiners else None
        self.quorum = Quorum(self._qid, step, tuple(members), committed, donor, tuple(joiners), epoch, resumed)
        self.aborted, self._formed_at = False, now
        self.committed = committed if committed is not None else self.committed
        for r in joiners:
            self.members[r].healing = False
        self.emit("quorum", qid=self._qid, step=step, members=list(members), committed=committed, joiners=list(joiners),
                  **({"resumed": True} if resumed else {}))
        message, self._unjoined = encode(json.loads(self.quorum.to_json())), set(members)  # encoded once
        for r in members:
            m = self.members[r]
            m.stuck, m.joined = False, None
            for conn in m.conns.values():  # every rank of a member: one small answer each
                self._send(conn, message)

    def _send(self, conn: socket.socket, message: dict | bytes) -> None:
        lock = self._send_locks.setdefault(conn, threading.Lock())
        try:
            with lock:
                conn.sendall(message if isinstance(message, bytes) else encode(message))
        except OSError:
            pass  # its reader sees the connection close and reports the loss


def main(argv: list[str] | None = None) -> int:
    from nvrx_lab.cli import Parser
    from nvrx_lab.net import shared_secret
    from nvrx_lab.observe.events import EventLog

    ap = Parser(prog="python -m nvrx_lab.replicas.coordinator", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (a pod's: 0.0.0.0)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--store-port", type=int, default=0, help="the groups' TCPStore port (default 0: any free one)")
    ap.add_argument("--replicas", type=int, required=True, help="replica groups of the job (the first quorum waits for all)")
    ap.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a new step starts with")
    ap.add_argument("--beat-timeout", type=float, default=5.0, help="a member silent this long is gone (s)")
    ap.add_argument("--first-quorum-timeout", type=float, default=FIRST_QUORUM_TIMEOUT_S,
                    help="how long the first quorum waits for every group before it starts with --min-replicas (s)")
    ap.add_argument("--metrics", default=None, help="event stream (quorums, losses)")
    a = ap.parse_args(argv)
    coord = Coordinator(a.replicas, a.min_replicas, a.beat_timeout, emit=EventLog(a.metrics, rank=-1).emit,
                        first_quorum_timeout=a.first_quorum_timeout, secret=shared_secret())
    print(f"[nvrx_lab.replicas] coordinator on {a.host}:{a.port}, {a.replicas} replica groups", flush=True)
    serve(coord, a.host, a.port, store_port=a.store_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
