"""A repeat offender for ``python -m nvrx_lab.bench nodes``: a node whose GPU fails again after every restart.

The faults that cost a real job the most repeat: a node with a failing GPU kills its worker a few steps into every
attempt, and without a health check it rejoins each round. Three kinds, one Job each, node ``--node`` the bad one:

* ``once`` — its worker is killed once (an Xid: the process dies), and the node is healthy after: the single-fault
  reference;
* ``repeat`` — the same, again ``--gap`` steps into every attempt it trains in, health checks off: it rejoins each
  round;
* ``repeat+checks`` — the same node, health checks on and one hot spare: the fault also takes the node's RDMA port
  down (its own sysfs tree, ``$NVRX_LAB_HEALTH_SYSFS``), its launcher leaves with exit 5 at the next round and the
  spare takes its place; its replacement pod lands on a healthy node (on EKS: the marked node's taint and affinity),
  so the bench stops striking once the bad pod has exited 5.

The kill is the bench's, not the trainer's: a fault bound to a node, not to a rank (a spare takes over the rank). The
first one is armed in the trainer's schedule: the bad node's worker pauses at its step until the bench has killed it
(:func:`~nvrx_lab.eks.local_roles.hold`), so a fast run cannot pass the step before the bench looks.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from nvrx_lab.eks.local import LocalJob
from nvrx_lab.eks.local_roles import describe, held, hold, node_ranks, pod_with, trainers
from nvrx_lab.exit_codes import UNHEALTHY
from nvrx_lab.net import wait_for
from nvrx_lab.observe.events import read_events

KINDS = ("once", "repeat", "repeat+checks")
PORT = {True: ("4: ACTIVE", "5: LinkUp"), False: ("1: DOWN", "3: Disabled")}


def port_tree(root: Path, up: bool) -> str:
    """A node's ``/sys/class/infiniband``: one RDMA device, its port up or down."""
    port = root / "rdmap0s0" / "ports" / "1"
    port.mkdir(parents=True, exist_ok=True)
    (port / "state").write_text(PORT[up][0] + "\n")
    (port / "phys_state").write_text(PORT[up][1] + "\n")
    return str(root)


def node_trees(workdir: Path, pods: int) -> dict[int, dict[str, str]]:
    """Each pod's own sysfs tree, every port up: ``LocalOptions.pod_env``."""
    return {i: {"NVRX_LAB_HEALTH_SYSFS": port_tree(workdir / "sys" / f"node-{i}", True)} for i in range(pods)}


def _steps(events: Path, since: float) -> list[int]:
    return [e["step"] for e in read_events(events, "step") if e["rank"] == 0 and e["t"] > since] if events.exists() else []


def first_hold(a) -> str:
    """The trainer's fault that arms the first strike: the last rank of node rank ``a.node`` held at step
    ``a.first_step`` (:func:`~nvrx_lab.eks.local_roles.hold`) until the bench kills it."""
    return hold(a.node * a.nproc + a.nproc - 1, [a.first_step])


def strike(job: LocalJob, events: Path, a, kind: str, over) -> tuple[list[float], dict[int, int]]:
    """Kill the bad node's worker held at step ``a.first_step`` (:func:`first_hold`), then (``repeat``) ``a.gap`` steps into
    every attempt it trains in, until the Job is ``over()`` or the node left (exit 5); returns the kill times and the
    first round's roles (pod -> node rank, :func:`~nvrx_lab.eks.local_roles.node_ranks`), said in one line. The bad
    node is a role: the pod that holds node rank ``a.node`` in the first round (the rendezvous decides by arrival
    which pods train and which waits as the spare)."""
    kills: list[float] = []
    roles: dict[int, int] = {}
    bad = -1

    def kill(pid: int) -> None:
        if kind == "repeat+checks":  # NVML/sysfs see it before its launcher's next round looks
            port_tree(Path(job.run.pods[bad].env["NVRX_LAB_HEALTH_SYSFS"]), up=False)
        os.kill(pid, signal.SIGKILL)  # the GPU fell off the bus: its process dies
        kills.append(time.time())

    def finished() -> bool:
        """One look: strike if it is due; True once nothing is left to strike."""
        nonlocal bad, roles
        if over() or (kills and kind == "once"):
            return True
        if not kills:  # the first strike: the held worker's fault event says it is due
            if (fault := held(events)) is None:
                return False
            roles = node_ranks(job, events, a.nproc)
            bad = pod_with(roles, a.node)
            print(f"[nodes] {kind}: roles in the first round: {describe(roles, len(job.run.pods))}; the bad node is "
                  f"node rank {a.node} (pod {bad})", flush=True)
            pid = next((pid for pid, rank in trainers(job, bad, events) if rank == fault["rank"]), None)
            if pid is None:
                raise RuntimeError(f"rank {fault['rank']}, held at step {a.first_step}, is gone before its kill "
                                   f"(its launcher restarted it: raise --heartbeat-timeout?)")
            kill(pid)
            return False
        if UNHEALTHY in job.run.pods[bad].returncodes:  # it left: its replacement (just started) lands on a healthy node
            port_tree(Path(job.run.pods[bad].env["NVRX_LAB_HEALTH_SYSFS"]), up=True)
            return True
        pids = [pid for pid, _ in trainers(job, bad, events, kills[-1])]
        if pids and len(_steps(events, kills[-1])) >= a.gap:  # polled: a run may finish first (the bench's repeat only)
            kill(pids[-1])
        return False

    wait_for(finished, float("inf"), "the bad node's faults", interval=0.1)  # over() bounds it (the Job's deadline)
    return kills, roles


def trained(events: list[dict]) -> dict:
    """What a Job trained: its last step, rank 0's median step time, and the wall clock from its first step to its
    last event (goodput = steps x an ideal step time / that wall: :func:`goodput`)."""
    steps = [e for e in events if e["kind"] == "step" and e["rank"] == 0]
    if len(steps) < 2:
        return {"steps": 0, "step_s": float("nan"), "wall_s": float("nan")}
    times = sorted(e["step_time"] for e in steps)
    wall = max(e["t"] for e in events) - (steps[0]["t"] - steps[0]["step_time"])
    return {"steps": max(e["step"] for e in steps), "step_s": times[len(times) // 2], "wall_s": wall}


def goodput(rows: list[dict]) -> None:
    """Each row's ``goodput`` against one ideal step time: the fastest median of the rows' Jobs (same trainer, same
    box), so a row whose steps ran slower is not flattered by its own median."""
    jobs = [j for row in rows for j in row.get("trained", [])]
    ideal = min((j["step_s"] for j in jobs if j["steps"]), default=float("nan"))
    for row in rows:
        each = [j["steps"] * ideal / j["wall_s"] for j in row.get("trained", []) if j["steps"]]
        row["goodput"] = sorted(each)[len(each) // 2] if each else float("nan")
