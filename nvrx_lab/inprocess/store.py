"""The wrapper's store: fault reports, heartbeats and rendezvous between attempts
==================================================================================

A ``torch.distributed.TCPStore`` of its own at ``MASTER_ADDR:MASTER_PORT+1`` (overridable),
separate from torchrun's rendezvous store. It is hosted by rank 0's *monitor process* (see
:mod:`.monitor_process`), not by rank 0 itself, so it outlives a SIGKILL of rank 0. Keys:

==========================  ===============================================================
``hb/<r>``                  heartbeat counter of initial rank ``r``; judged once, by the store host
``dead/<r>``, ``dead``      death notice (JSON); ``dead`` lists the dead (``"3,7,"``), ``ndead`` counts them
``it/<n>/faults``           the fault reports of attempt ``n``, one JSON line each
``it/<n>/ndone``            ranks that returned from attempt ``n``
``it/<n>/end``              how attempt ``n`` ended: ``fault`` or ``done`` (first writer wins)
``it/<n>/pg/...``           the attempt's process-group rendezvous (a fresh prefix each time)
``rdzv/<n>/arrived``        ranks ready for attempt ``n`` (``"0,2,"``), ``rdzv/<n>/count`` counts them
``rdzv/<n>/members``        the decision (first complete proposal wins); ``attempt``: newest decided
``gone``, ``ngone``         ranks that left for good
==========================  ===============================================================

At 1,024 ranks every event costs each rank O(1) store operations, and no rank ever loops over
the others' keys: a list that grows by ``append`` is read in one ``get``, a counter in one
``add(key, 0)``, and the end of an attempt or a rendezvous is one blocking ``wait`` on one key
(the server answers when it is set; nobody polls it). Heartbeats are judged in one place, the
store host, with one ``multi_get`` per interval (see ``python -m nvrx_lab.bench scale``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from array import array
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from nvrx_lab.net import accepting, listen, wait_for


def connect(host: str, port: int, timeout: float = 60.0) -> dist.TCPStore:
    """A client of the wrapper's store, once its host listens (polled every 5 ms: ``TCPStore``'s own retry backs
    off to ~0.5 s, which a rank started before rank 0's monitor paid at every restart), or ``timeout``."""
    wait_for(lambda: accepting(host, port), timeout, f"the in-process restart store at {host}:{port}", interval=0.005)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def connect_reporting(host: str, port: int, timeout: float, on_poll) -> dist.TCPStore:
    """:func:`connect` in a thread of its own while this one calls ``on_poll`` (e.g. writes its
    progress): a connect can stall for seconds on a reverse-DNS lookup of the peer's address, and a
    rank's hard timeout must not take that for a hang."""
    box: dict = {}

    def open_client() -> None:
        try:
            box["client"] = connect(host, port, timeout)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=open_client, name="nvrx-inprocess-connect", daemon=True)
    thread.start()
    wait_for(lambda: not thread.is_alive(), timeout + 5, f"a store client of {host}:{port}", interval=0.005,
             on_poll=on_poll)
    if "error" in box:
        raise box["error"]
    return box["client"]


def host(port: int, bind: str = "127.0.0.1", timeout: float = 60.0) -> dist.TCPStore:
    """Start the store server on ``bind:port``: the address the ranks connect to (``MASTER_ADDR``),
    loopback on one node — never every interface, which ``TCPStore`` would listen on by itself."""
    sock = listen(bind, port)
    return dist.TCPStore(bind, port, is_master=True, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False, master_listen_fd=sock.detach())


def ranks_of(value: bytes | str) -> set[int]:
    """The ranks of an appended list (``"3,-1,7,"``)."""
    text = value.decode() if isinstance(value, bytes) else value
    return {int(x) for x in text.split(",") if x}


NOT_MEMBER, SPARE = -2, -1
"""Entries of a decision's table that are not a new rank."""


def encode_decision(assignment: dict[int, int | None]) -> bytes:
    """A rendezvous decision as every rank fetches it: a table of little-endian int32 indexed by initial rank
    (the new rank, :data:`SPARE`, or :data:`NOT_MEMBER`). At 4,096 ranks it is 16 KB, and a rank reads its own
    entry without decoding the rest (:class:`Decision`); a JSON object of the same map took 1.4 ms of Python on
    every rank of every restart, which on the scale model's two cores is 5.7 s at 4,096 ranks."""
    table = array("i", [NOT_MEMBER]) * (max(assignment, default=-1) + 1)
    for r, k in assignment.items():
        table[r] = SPARE if k is None else k
    if sys.byteorder == "big":
        table.byteswap()
    return table.tobytes()


class Decision(Mapping):
    """``{initial rank: new rank or None}`` over a decided table (:func:`encode_decision`): built and looked up
    in O(1); iterating it walks the table. Every member of the attempt is a key (a policy maps every survivor,
    active or spare)."""

    __slots__ = ("_table",)

    def __init__(self, value: bytes):
        self._table = array("i")
        self._table.frombytes(value)
        if sys.byteorder == "big":
            self._table.byteswap()

    def __getitem__(self, rank: int) -> int | None:
        if type(rank) is int and 0 <= rank < len(self._table) and (k := self._table[rank]) != NOT_MEMBER:
            return None if k == SPARE else k
        raise KeyError(rank)

    def __iter__(self):
        return (r for r, k in enumerate(self._table) if k != NOT_MEMBER)

    def __len__(self) -> int:
        return len(self._table) - self._table.count(NOT_MEMBER)

    def __repr__(self) -> str:
        return f"Decision({dict(self)})"


class RestartStore:
    """Typed helpers over one store client (one per thread: clients are not shared)."""

    def __init__(self, client: dist.Store):
        self.client = client

    def get_or_empty(self, key: str) -> bytes:
        """The value of ``key``, or ``b""`` if it was never set: one operation (``compare_set``
        sets a missing key to ``""``, and leaves an existing one as it is). Also the read of a key known
        to exist: ``TCPStore.get`` is two requests, a ``wait`` for the key and then the read."""
        return self.client.compare_set(key, "", "")

    def wait(self, key: str, timeout: float) -> None:
        """Block until ``key`` exists (one operation; the server answers when it is set)."""
        self.client.wait([key], timedelta(seconds=timeout))

    # -- heartbeats and deaths ---------------------------------------------------------------
    def beat(self, rank: int) -> None:
        self.client.add(f"hb/{rank}", 1)

    def heartbeats(self, world_size: int, started: bool = False) -> dict[int, int] | None:
        """Every rank's counter in one ``multi_get``; ``None`` until every rank has beaten once
        (``started``: known already, skip the ``check``)."""
        keys = [f"hb/{r}" for r in range(world_size)]
        if not (started or self.client.check(keys)):
            return None
        return {r: int(v) for r, v in enumerate(self.client.multi_get(keys))}

    def announce_death(self, rank: int, cause: str, detail: str, t: float) -> None:
        self.client.set(f"dead/{rank}", json.dumps({"rank": rank, "cause": cause, "detail": detail, "t": t}))
        self.client.append("dead", f"{rank},")
        self.client.add("ndead", 1)

    def dead_ranks(self) -> set[int]:
        return ranks_of(self.get_or_empty("dead"))

    def ndead(self) -> int:
        return self.client.add("ndead", 0)

    def deaths(self, ranks) -> dict[int, dict]:
        """Death notices of ``ranks``: one ``get`` of the list, one ``multi_get`` of the notices."""
        dead = sorted(self.dead_ranks() & set(ranks))
        if not dead:
            return {}
        values = self.client.multi_get([f"dead/{r}" for r in dead])
        return {r: json.loads(v) for r, v in zip(dead, values, strict=True)}

    # -- faults and the end of an attempt --------------------------------------------------------
    def report_fault(self, iteration: int, rank: int, cause: str, detail: str, t: float | None = None,
                     waiting: bool | None = None) -> None:
        """Add a fault report to attempt ``iteration`` (one ``append``) and end the attempt; ``waiting``: a hang's
        rank sat in a ``torch.distributed`` call (waiting on a peer, :mod:`.where`)."""
        record = {"iteration": iteration, "rank": rank, "cause": cause, "detail": detail[:2000],
                  "t": time.time() if t is None else t}
        if waiting is not None:
            record["waiting"] = waiting
        self.client.append(f"it/{iteration}/faults", json.dumps(record) + "\n")
        self.client.compare_set(self.end_key(iteration), "", "fault")

    def has_fault(self, iteration: int) -> bool:
        """Whether attempt ``iteration`` has a fault report (one operation)."""
        return bool(self.get_or_empty(f"it/{iteration}/faults"))

    def faults(self, iteration: int) -> list[dict]:
        """Every fault report of attempt ``iteration``, in the order they were made (one operation)."""
        return [json.loads(line) for line in self.get_or_empty(f"it/{iteration}/faults").decode().splitlines()]

    @staticmethod
    def end_key(iteration: int) -> str:
        return f"it/{iteration}/end"

    def end(self, iteration: int) -> str:
        """How attempt ``iteration`` ended (``fault``/``done``); call once :meth:`end_key` exists
        (a key is never created empty here: a ``wait`` on it would wake too early)."""
        return self.get_or_empty(self.end_key(iteration)).decode()

    def mark_done(self, iteration: int, rank: int, active: int) -> None:
        """``rank`` returned; the last of the ``active`` ranks ends the attempt as ``done``."""
        if self.client.add(f"it/{iteration}/ndone", 1) >= active:
            self.client.compare_set(self.end_key(iteration), "", "done")

    # -- rendezvous ------------------------------------------------------------------------------
    def arrive(self, iteration: int, rank: int) -> int:
        """``rank`` is ready for attempt ``iteration``; returns how many have arrived."""
        self.client.append(f"rdzv/{iteration}/arrived", f"{rank},")
        return self.client.add(f"rdzv/{iteration}/count", 1)

    def arrived(self, iteration: int) -> set[int]:
        return ranks_of(self.get_or_empty(f"rdzv/{iteration}/arrived"))

    @staticmethod
    def members_key(iteration: int) -> str:
        return f"rdzv/{iteration}/members"

    def decide_members(self, iteration: int, assignment: dict[int, int | None]) -> Decision:
        """First proposal wins (``compare_set``); every caller gets the decided assignment. The winner
        records ``attempt`` (the newest decided rendezvous, for death notices to find)."""
        mine = encode_decision(assignment)
        value = self.client.compare_set(self.members_key(iteration), "", mine)
        if value == mine:
            self.client.set("attempt", str(iteration))
        return Decision(value)

    def decided_members(self, iteration: int, known_to_exist: bool = False) -> Decision | None:
        """The decided ``{initial rank: new rank or None}`` of rendezvous ``iteration``, or None if undecided."""
        key = self.members_key(iteration)
        if not (known_to_exist or self.client.check([key])):
            return None
        return Decision(self.get_or_empty(key))  # it exists: this does not create it

    def latest_decided(self) -> int:
        """The newest decided rendezvous, -1 before the first."""
        return int(self.get_or_empty("attempt") or -1)

    def leave(self, rank: int) -> None:
        self.client.append("gone", f"{rank},")
        self.client.add("ngone", 1)

    def gone_ranks(self) -> set[int]:
        return ranks_of(self.get_or_empty("gone"))

    def all_gone(self, world_size: int) -> bool:
        """Every initial rank has left for good: finished (``gone``) or known dead (``dead``)."""
        if self.client.add("ngone", 0) + self.ndead() < world_size:
            return False
        return self.gone_ranks() | self.dead_ranks() >= set(range(world_size))
