"""One side of two large heals over a real quorum group (gloo): ``donor`` or ``joiner``, ``MB`` of state each.

``python heal_large.py ROLE STORE_PORT MB --die-after N``: the donor sends a seeded state of MB megabytes (a few
tensors, as a shard of parameters and optimizer moments), the joiner receives it into its own tensors in place; then
again, and the donor SIGKILLs itself after the N-th chunk of that second heal. Each side prints a ``RESULT {json}``
line a heal: the bytes, the seconds, the chunks and a SHA-256 of the state's bytes, or the error that ended it (and the
seconds since its last chunk).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from nvrx_lab.replicas.group import ReplicaGroup, StepAborted
from nvrx_lab.replicas.heal import recv_state, send_state
from nvrx_lab.replicas.protocol import Quorum


def state(mb: int, fill: bool) -> dict:
    """Three tensors of about ``mb`` MB in all (parameters, and Adam's two moments), and the plain values beside."""
    n = mb * (1 << 20) // 4 // 3
    gen = torch.Generator().manual_seed(0)
    make = (lambda: torch.randn(n, generator=gen)) if fill else (lambda: torch.zeros(n))
    return {"model": {"w": make()}, "optim": {"state": {"w": {"exp_avg": make(), "exp_avg_sq": make()}},
                                              "param_groups": [{"lr": 3e-3 if fill else 0.0}]}, "step": 7 if fill else 0}


def digest(sd: dict) -> str:
    h = hashlib.sha256()
    for t in (sd["model"]["w"], sd["optim"]["state"]["w"]["exp_avg"], sd["optim"]["state"]["w"]["exp_avg_sq"]):
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["donor", "joiner"])
    ap.add_argument("port", type=int)
    ap.add_argument("mb", type=int)
    ap.add_argument("--die-after", type=int, required=True)
    a = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=timedelta(seconds=60))
    replica = 0 if a.role == "donor" else 1
    quorum = Quorum(qid=1, step=8, members=(0, 1), committed=7, donor=0, joiners=(1,))
    group = ReplicaGroup(store, quorum, replica, 0, torch.device("cpu"), timeout_s=60).connect(lambda: False)
    for heal, die_after in enumerate((0, a.die_after)):
        die_after = die_after if a.role == "donor" else 0
        print("RESULT " + json.dumps(one_heal(group, a.role, a.mb, die_after) | {"heal": heal}), flush=True)
    group.close()


def one_heal(group: ReplicaGroup, role: str, mb: int, die_after: int) -> dict:
    """One heal's figures; an error's carries ``after_last_s``, the seconds from the last chunk to it: what the donor's
    death cost, apart from the donor's own work before it (its SHA-256 and the next state's 512 MB of randn)."""
    sd, chunks = state(mb, fill=role == "donor"), []

    def chunk() -> None:
        chunks.append(time.monotonic())
        if die_after and len(chunks) == die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    t0 = time.monotonic()
    try:
        if role == "donor":
            result = {"bytes": send_state(group, [1], sd, lambda: False, chunk)}
        else:
            got = recv_state(group, 0, sd, lambda: False, chunk)
            result = {"step": got["step"], "lr": got["optim"]["param_groups"][0]["lr"]}
        return result | {"seconds": time.monotonic() - t0, "chunks": len(chunks), "digest": digest(sd)}
    except StepAborted as e:
        now = time.monotonic()
        return {"error": str(e), "seconds": now - t0, "chunks": len(chunks), "after_last_s": now - (chunks or [t0])[-1]}


if __name__ == "__main__":
    main()
