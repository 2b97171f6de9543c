"""The wrapper's store: fault reports, heartbeats and rendezvous between attempts
==================================================================================

A ``torch.distributed.TCPStore`` of its own at ``MASTER_ADDR:MASTER_PORT+1`` (overridable),
separate from torchrun's rendezvous store. It is hosted by rank 0's *monitor process* (see
:mod:`.monitor_process`), not by rank 0 itself, so it outlives a SIGKILL of rank 0. Keys:

==========================  ===============================================================
``hb/<r>``                  heartbeat counter of initial rank ``r`` (its monitor thread)
``dead/<r>``                death notice (JSON) written by ``r``'s monitor process
``it/<n>/fault/<k>``        the k-th fault report of attempt ``n`` (JSON); ``it/<n>/nfaults``
``it/<n>/done/<r>``         rank ``r`` returned from attempt ``n``
``it/<n>/pg/...``           the attempt's process-group rendezvous (a fresh prefix each time)
``rdzv/<n>/arrived/<r>``    ``r`` is ready for attempt ``n``; ``rdzv/<n>/members`` decides it
``gone/<r>``                ``r`` left for good (the host exits when every rank is gone or dead)
==========================  ===============================================================

Every wait on these keys polls them with :func:`nvrx_lab.net.wait_for`, with a deadline wherever a
dead peer could otherwise hang it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

from nvrx_lab.net import listen


def connect(host: str, port: int, timeout: float = 60.0) -> dist.TCPStore:
    """A client of the wrapper's store (retries until the host is up or ``timeout``)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def host(port: int, bind: str = "127.0.0.1", timeout: float = 60.0) -> dist.TCPStore:
    """Start the store server on ``bind:port``: the address the ranks connect to (``MASTER_ADDR``),
    loopback on one node — never every interface, which ``TCPStore`` would listen on by itself."""
    sock = listen(bind, port)
    return dist.TCPStore(bind, port, is_master=True, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False, master_listen_fd=sock.detach())


class RestartStore:
    """Typed helpers over one store client (one per thread: clients are not shared)."""

    def __init__(self, client: dist.Store):
        self.client = client

    # -- heartbeats and deaths ---------------------------------------------------------------
    def beat(self, rank: int) -> None:
        self.client.add(f"hb/{rank}", 1)

    def heartbeats(self, ranks: Iterable[int]) -> dict[int, int]:
        ranks = [r for r in ranks if self.client.check([f"hb/{r}"])]
        if not ranks:
            return {}
        values = self.client.multi_get([f"hb/{r}" for r in ranks])
        return {r: int(v) for r, v in zip(ranks, values, strict=True)}

    def announce_death(self, rank: int, cause: str, detail: str, t: float) -> None:
        self.client.set(f"dead/{rank}", json.dumps({"rank": rank, "cause": cause, "detail": detail, "t": t}))

    def deaths(self, ranks: Iterable[int]) -> dict[int, dict]:
        out = {}
        for r in ranks:
            if self.client.check([f"dead/{r}"]):
                out[r] = json.loads(self.client.get(f"dead/{r}"))
        return out

    # -- faults ------------------------------------------------------------------------------
    def report_fault(self, iteration: int, rank: int, cause: str, detail: str, t: float | None = None) -> int:
        """Append a fault report for attempt ``iteration``; returns its index (0 = first)."""
        record = {"iteration": iteration, "rank": rank, "cause": cause, "detail": detail[:2000],
                  "t": time.time() if t is None else t}
        k = self.client.add(f"it/{iteration}/nfaults", 1) - 1
        self.client.set(f"it/{iteration}/fault/{k}", json.dumps(record))
        return k

    def has_fault(self, iteration: int) -> bool:
        return self.client.check([f"it/{iteration}/fault/0"])

    def faults(self, iteration: int) -> list[dict]:
        if not self.client.check([f"it/{iteration}/nfaults"]):
            return []
        n = self.client.add(f"it/{iteration}/nfaults", 0)
        keys = [f"it/{iteration}/fault/{k}" for k in range(n)]
        keys = [k for k in keys if self.client.check([k])]
        return [json.loads(v) for v in self.client.multi_get(keys)] if keys else []

    # -- completion and rendezvous -------------------------------------------------------------
    def mark_done(self, iteration: int, rank: int) -> None:
        self.client.set(f"it/{iteration}/done/{rank}", "1")

    def all_done(self, iteration: int, ranks: Iterable[int]) -> bool:
        return self.client.check([f"it/{iteration}/done/{r}" for r in ranks])

    def arrive(self, iteration: int, rank: int) -> None:
        self.client.set(f"rdzv/{iteration}/arrived/{rank}", "1")

    def arrived(self, iteration: int, ranks: Iterable[int]) -> set[int]:
        return {r for r in ranks if self.client.check([f"rdzv/{iteration}/arrived/{r}"])}

    def decide_members(self, iteration: int, proposal: dict) -> dict:
        """First proposal wins (``compare_set``); every caller gets the decided value."""
        value = self.client.compare_set(f"rdzv/{iteration}/members", "", json.dumps(proposal))
        return json.loads(value)

    def decided_members(self, iteration: int) -> dict | None:
        key = f"rdzv/{iteration}/members"
        return json.loads(self.client.get(key)) if self.client.check([key]) else None

    def leave(self, rank: int) -> None:
        self.client.set(f"gone/{rank}", "1")

    def all_gone(self, world_size: int) -> bool:
        """Every initial rank has left for good: finished (``gone``) or known dead (``dead``)."""
        return all(self.client.check([f"gone/{r}"]) or self.client.check([f"dead/{r}"])
                   for r in range(world_size))
