"""Which processes a benchmark run left behind: every process of a run carries ``NVRX_BENCH_TAG`` in its
environment (children inherit it, orphans reparented to init keep it), so a scan of the machine finds
them however they were started (a launcher's workers, standby zygotes, checkpoint writers, monitors); what is left
is killed as a lost node's processes are (:func:`nvrx_lab.eks.local.kill_tree`).
"""

from __future__ import annotations

import os
import uuid

import psutil

from nvrx_lab.net import wait_for

TAG_VAR = "NVRX_BENCH_TAG"


def new_tag(prefix: str = "run") -> str:
    """A tag unique to one run of a benchmark case."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes (not zombies) of this user whose environment carries ``tag``."""
    out = []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.pid == os.getpid() or p.info["uids"] is None or p.info["uids"].real != os.getuid():
                continue
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TAG_VAR) == tag:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def leftovers(tag: str, grace_s: float = 5.0) -> list[str]:
    """What of run ``tag`` is still running ``grace_s`` after it ended (each described); then killed."""
    try:
        wait_for(lambda: not tagged(tag), grace_s, f"processes of {tag} to exit", interval=0.2)
        return []
    except TimeoutError:
        pass
    from nvrx_lab.eks.local import kill_tree  # here: importing nvrx_lab.eks (kubernetes) takes seconds, paid only now

    found = tagged(tag)
    described = []
    for p in found:
        try:
            described.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
        kill_tree(p)
    return described
