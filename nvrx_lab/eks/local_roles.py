"""Which pod of a local Job does what: the node rank its trainers hold in the round that trains now.

A rendezvous decides by arrival which pods train and which wait as hot spares, and numbers the admitted ones by
their sort key (the completion index): with a spare, "node 1" is whichever pod the first round admitted second, not
pod 1. A test or a benchmark that strikes a node names it by its role and finds its pod here, from the trainers'
``start`` events (each with its rank and pid) and each pod's process tree, so nothing depends on who came first::

    ranks = wait_for(lambda: len(r := node_ranks(job, events, nproc=2)) == 2 and r, 60, "the first round's roles")
    pod, spares = pod_with(ranks, node_rank=1), waiting(ranks, pods=3)

A strike at a step is armed the same way, in the run itself: :func:`hold` pauses a rank at that step (a ``pause``
fault in the trainer's schedule) until the test or bench has struck, which :func:`held` sees in the event stream, so
no run is too fast for the strike and no poll has to catch a step in passing.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import psutil

from nvrx_lab.eks.local_job import LocalJob
from nvrx_lab.eks.local_pods import LocalPod
from nvrx_lab.observe.events import read_events

HOLD_S = 600.0
"""Longest a held rank waits for its strike (the Job's deadline ends a run sooner)."""


def hold(rank: int, steps: list[int]) -> str:
    """The trainer's ``--faults`` entries that hold ``rank`` at each of ``steps`` (once each, remembered across
    restarts): it stops there, without a heartbeat, until it is struck."""
    return ",".join(f"{rank}:{step}:pause:{HOLD_S:g}" for step in steps)


def held(events: Path, step: int | None = None) -> dict | None:
    """The ``fault`` event of the first hold (at ``step`` if given) in ``events``; None until a rank is held."""
    holds = [e for e in read_events(events, "fault") if e["fault"] == "pause"] if events.exists() else []
    return next((e for e in holds if step is None or e["step"] == step), None)


def _started(events: Path, since: float) -> dict[int, int]:
    """pid -> rank of every trainer that started after ``since`` (wall time)."""
    return {e["pid"]: e["rank"] for e in read_events(events, "start") if e["t"] > since and "pid" in e} \
        if events.exists() else {}


def _of(pod: LocalPod, started: dict[int, int]) -> list[tuple[int, int]]:
    if pod.proc is None or pod.proc.poll() is not None:
        return []
    with contextlib.suppress(psutil.NoSuchProcess):
        return sorted((c.pid, started[c.pid]) for c in psutil.Process(pod.proc.pid).children(recursive=True)
                      if c.pid in started)
    return []


def trainers(job: LocalJob, index: int, events: Path, since: float = 0.0) -> list[tuple[int, int]]:
    """(pid, rank) of each live trainer of pod ``index`` that started after ``since`` (wall time), by pid."""
    return _of(job.run.pods[index], _started(events, since))


def node_ranks(job: LocalJob, events: Path, nproc: int, since: float = 0.0) -> dict[int, int]:
    """Pod index -> the node rank (its first rank // ``nproc``) of its trainers (:func:`trainers`); a pod with none
    (a spare waiting, a pod not started yet, one between rounds) is absent."""
    started = _started(events, since)
    return {pod.index: min(r for _, r in each) // nproc for pod in job.run.pods if (each := _of(pod, started))}


def pod_with(ranks: dict[int, int], node_rank: int) -> int:
    """The pod that holds ``node_rank`` in ``ranks`` (:func:`node_ranks`); ``LookupError`` naming the roles if none."""
    pod = next((i for i, r in ranks.items() if r == node_rank), None)
    if pod is None:
        raise LookupError(f"no pod holds node rank {node_rank}: {describe(ranks, max(ranks, default=-1) + 1)}")
    return pod


def waiting(ranks: dict[int, int], pods: int) -> list[int]:
    """The pods of ``pods`` that hold no node rank in ``ranks``: the spares waiting (or pods not started)."""
    return [i for i in range(pods) if i not in ranks]


def describe(ranks: dict[int, int], pods: int) -> str:
    """``"node rank 0 = pod 0, node rank 1 = pod 2; waiting: pod 1"``: the roles as one log line says them."""
    trains = ", ".join(f"node rank {r} = pod {i}" for i, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    spares = waiting(ranks, pods)
    return trains + (f"; waiting: pod {', '.join(map(str, spares))}" if spares else "")
