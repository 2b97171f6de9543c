"""``python -m nvrx_lab.bench nodes``: four "nodes" on one box, as the EKS Indexed Job runs them, and three faults
=================================================================================================================

``python -m nvrx_lab.bench nodes [--faults-per-kind 10] [--faults-per-job 5] [--quick]``

The rendered Job (:func:`nvrx_lab.eks.render.render`, modes ``ft_launcher`` and ``ft_launcher+inprocess``:
``--restart launcher`` and ``--restart launcher+inprocess``) at ``--nodes 4`` is run by
:class:`nvrx_lab.eks.local.LocalJob` (the Job controller's rules, ``podFailurePolicy`` included; every process of
the Job tagged by :mod:`nvrx_lab.bench._procs`): one pod = one ``python -m nvrx_lab.launcher`` agent with
``--nproc-per-node 2`` workers of the tiny trainer, every agent meeting at completion index 0's c10d
rendezvous endpoint, as on EKS. Faults on node rank ``--node`` (default 2; node 0 hosts the rendezvous store,
and losing it fails the whole Job on EKS too). A node rank is a role, not a pod: the rendezvous decides by arrival
which pods train, and a hot spare may hold any rank, so the pod is looked up in the round that trains
(:mod:`nvrx_lab.eks.local_roles`) and the run says which pod had which role:

* ``hang`` — its first rank hangs (the trainer's ``--faults RANK:STEP:hang``): missed heartbeats;
* ``sigkill`` — its second rank SIGKILLs itself (``RANK:STEP:sigkill``);
* ``node-loss`` — its pod's agent, workers and standby zygote SIGKILLed at once at a step
  (:meth:`~nvrx_lab.eks.local.LocalJob.lose_node`), then a replacement pod (same completion index) started, as the
  Job controller does for a pod whose node is gone (``DisruptionTarget``: not counted against ``backoffLimit``).

Time to training = fault (the ``fault`` event, or the kill) -> rank 0's first step after the first
``start``/``restart`` event that follows it (every rank takes part in a step). ``recovered`` counts faults
after which training resumed; the Job must also end with every pod exiting 0 (``job``), and no process
of the run may survive it (``left_running``, checked with psutil). The launcher's and the trainer's restart
log lines of each Job are kept in the JSON (``restart_log``); the table shows the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

from nvrx_lab.bench import _offender as offender
from nvrx_lab.bench._procs import TAG_VAR, leftovers, new_tag
from nvrx_lab.cli import Parser
from nvrx_lab.eks import JobSpec, LocalRun, render
from nvrx_lab.eks.local import LocalJob, LocalOptions
from nvrx_lab.eks.local_roles import describe, held, hold, node_ranks, pod_with
from nvrx_lab.eks.render import find
from nvrx_lab.exit_codes import UNHEALTHY
from nvrx_lab.net import wait_for
from nvrx_lab.observe.events import read_events
from nvrx_lab.observe.table import median, p95, report

KINDS = ("hang", "sigkill", "node-loss", "node-loss+spare", *offender.KINDS)
SPARE_AFTER_S = 3.0
"""``node-loss+spare``: the spare pod starts this long after the others, as pods of a real job start apart; nothing
relies on the order (a node is struck by the role it holds, :mod:`nvrx_lab.eks.local_roles`)."""
MODES = {"launcher": "ft_launcher", "launcher+inprocess": "ft_launcher+inprocess"}
"""The trainer's ``--restart`` -> the rendered Job's mode."""
TINY = ("--seq-len", "16", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--hidden-dim", "64", "--log-every", "1")
LOG_MARKS = ("[nvrx-lab-launch]", "RESTART", "FAULT injected")
"""Restart log lines: the launcher's, the in-process wrapper's, the fault injector's."""


class JobFailed(RuntimeError):
    """The Job failed (its ``backoffLimit`` or its ``podFailurePolicy``), or ended before a fault could strike."""


def fault_steps(a) -> list[int]:
    return [a.first_step + i * a.gap for i in range(a.faults)]


def job_spec(restart: str, kind: str, a, name: str, memory: Path) -> JobSpec:
    """The Job of one run: ``a.faults`` faults of ``kind`` on node ``a.node``, ``a.gap`` steps apart; with local
    checkpoints, node I keeps them in ``memory/node-I`` (its ``/dev/shm``: nodes on one box share the real one)."""
    rank = a.node * a.nproc + (1 if kind == "sigkill" else 0)
    faults = ",".join(f"{rank}:{s}:{kind}" for s in fault_steps(a)) if kind in ("hang", "sigkill") else \
        offender.first_hold(a) if kind in offender.KINDS else hold(rank, fault_steps(a))  # node-loss: held, then lost
    extra = (*TINY, *(("--local-ckpt-dir", str(memory / "node-{node}")) if a.local_ckpt_interval else ()),
             *(("--step-sleep", f"{a.step_sleep:g}") if a.step_sleep else ()))
    spec = JobSpec(name=name, image="local", nodes=a.nodes, spare_nodes=int(kind.endswith(("+spare", "+checks"))),
                   mode=MODES[restart], workload="job", steps=fault_steps(a)[-1] + a.gap, mark_unhealthy_nodes=False,
                   ckpt_interval=a.ckpt_interval, faults=faults, train_extra=extra, max_restarts=3 * a.faults + 3,
                   heartbeat_timeout=a.heartbeat_timeout, initial_heartbeat_timeout=60, monitor_interval=0.2,
                   section_timeouts={"checkpoint": 30}, local_ckpt_interval=a.local_ckpt_interval,
                   local_ckpt_gib=1 if a.local_ckpt_interval else 0)
    if kind == "repeat":  # the bad node rejoins every round: nothing looks at it first
        return dataclasses.replace(spec, launcher=dataclasses.replace(spec.launcher, health_checks=False))
    return spec


def with_rdzv_conf(manifests: list[dict], conf: str) -> list[dict]:
    """``manifests`` whose container script puts the c10d settings ``conf`` after its own ``--rdzv-conf`` values,
    which they override (the last of a key wins), e.g. ``keep_alive_interval=5`` (torch's own: a lost node leaves the
    rendezvous after 15 s; the manifests' ``JobSpec.rdzv_keep_alive_s`` is 0.5 s up to 620 nodes)."""
    cont = find(manifests, "Job")[0]["spec"]["template"]["spec"]["containers"][0]
    if not any('--rdzv-conf="' in arg for arg in [*cont.get("command", []), *cont.get("args", [])]):
        raise ValueError("rdzv_conf: the Job's script has no --rdzv-conf (a mode without the launcher)")
    for key in ("command", "args"):
        if key in cont:
            cont[key] = [re.sub(r'(--rdzv-conf="[^"]*)"', lambda m: f'{m.group(1)},{conf}"', arg) for arg in cont[key]]
    return manifests


def over(job: LocalJob) -> bool:
    """One pass of the Job's controller: True once every pod exited 0; :class:`JobFailed` once the Job failed."""
    if not job.poll():
        return False
    if job.run.status == "Failed":
        last = next((e.index for e in reversed(job.run.events) if e.kind == "exit"), 0)
        raise JobFailed(f"the Job failed ({job.run.reason}): {job.run.failures} pod failures counted, backoffLimit "
                        f"{job.backoff}\n{tail(job.run, last)}")
    return True


def tail(run: LocalRun, index: int, chars: int = 3000) -> str:
    return f"--- {run.pods[index].hostname}, last attempt ---\n{run.log(index)[-chars:]}"


def log_lines(run: LocalRun, *marks: str) -> list[str]:
    """Lines of every pod's logs containing one of ``marks``, as ``node I attempt J: LINE``."""
    return [f"node {pod.index} attempt {j}: {line}" for pod in run.pods for j, path in enumerate(pod.logs)
            for line in path.read_text(errors="replace").splitlines() if any(m in line for m in marks)]


def strike(job: LocalJob, events: Path, a, memory: Path, deadline: float) -> None:
    """Lose node rank ``a.node`` (its pod and its memory) at each fault step, all before the monotonic ``deadline``:
    its rank is held at the step (:func:`~nvrx_lab.eks.local_roles.hold`) until its node is lost, so no run passes
    the step first. Node rank is a role: the rendezvous decides by arrival which pods train (a spare may hold it, or
    have taken its place), so its pod is looked up in the round that trains, and the line says the roles."""
    since = 0.0
    for step in fault_steps(a):
        def due() -> bool:
            if over(job):
                raise JobFailed(f"the Job ended before node rank {a.node} was held at step {step}")  # noqa: B023
            return held(events, step) is not None  # noqa: B023

        wait_for(due, deadline - time.monotonic(), f"node rank {a.node} held at step {step}", interval=0.05)
        ranks = node_ranks(job, events, a.nproc, since)
        node = pod_with(ranks, a.node)
        print(f"[nodes] losing node rank {a.node} (pod {node}) at step {step}: {describe(ranks, len(job.run.pods))}",
              flush=True)
        since = job.lose_node(node, wipe=[memory / f"node-{node}"])


def recoveries(events: list[dict], faults: list[float]) -> list[float | None]:
    """Per fault time: seconds to rank 0's first step after the first (re)start that follows it; None: never."""
    events = sorted(events, key=lambda e: e["t"])
    out: list[float | None] = []
    for t in faults:
        restart = next((e["t"] for e in events if e["t"] > t and e["kind"] in ("start", "restart")), None)
        step = None if restart is None else next(
            (e["t"] for e in events if e["t"] > restart and e["kind"] == "step" and e["rank"] == 0), None)
        out.append(None if step is None else step - t)
    return out


def run_job(restart: str, kind: str, a, workdir: Path) -> dict:
    """One Job of ``a.faults`` faults: recovery times, launcher detection, pod failures, the restart log."""
    name = "nodes"  # each Job has a folder of its own (its FSx, its metrics, its nodes' memories)
    memory = workdir / "memory"
    manifests = render(job_spec(restart, kind, a, name, memory))
    manifests = with_rdzv_conf(manifests, a.rdzv_conf) if a.rdzv_conf else manifests
    tag = new_tag("nodes")
    spare = kind.endswith(("+spare", "+checks"))
    options = LocalOptions(workdir=workdir, max_procs_per_node=a.nproc, extra_env={TAG_VAR: tag}, max_nodes=a.nodes + spare,
                           replace_after_s=a.replace_after, start_after_s={a.nodes: SPARE_AFTER_S} if spare else {},
                           pod_env=offender.node_trees(workdir, a.nodes + spare))
    t0, error, kills, roles = time.monotonic(), None, [], {}
    deadline = t0 + a.job_timeout
    with LocalJob(manifests, options) as job:
        events = job.run.local_path(f"/fsx/{name}/metrics.jsonl")
        try:
            if kind.startswith("node-loss"):
                strike(job, events, a, memory, deadline)
            if kind in offender.KINDS:
                kills, roles = offender.strike(job, events, a, kind, lambda: over(job) or time.monotonic() > deadline)
            wait_for(lambda: over(job), deadline - time.monotonic(), "every pod to exit 0", interval=0.1)
        except JobFailed as e:
            error = str(e)
        except TimeoutError as e:
            error = f"{e}\n{tail(job.run, 0)}"
        job.close(grace_s=0)  # whatever still runs goes as a lost node does: every process of its tree at once
        lines = log_lines(job.run, *LOG_MARKS)
    left = leftovers(tag)
    ev = read_events(events) if events.exists() else []
    lost = [e.t for e in job.run.events if e.kind == "node-lost"]
    faults = lost if kind.startswith("node-loss") else kills if kind in offender.KINDS else \
        [e["t"] for e in ev if e["kind"] == "fault"]
    resumed = [e for e in ev if e["kind"] == "resume" and faults and e["t"] > min(faults)]
    return {"recovery": recoveries(ev, faults), "injected": len(faults), "pod_failures": job.run.failures,
            "sources": [e.get("source") for e in resumed], "rollback": [e.get("rollback_steps") for e in resumed],
            "detect": [e["detect_s"] for e in ev if e["kind"] == "launcher_failure" and e.get("detect_s")],
            "respawn": [e["respawn_s"] for e in ev if e["kind"] == "launcher_restart" and e.get("respawn_s")],
            "left": left, "error": error, "restart_log": lines, "wall_s": time.monotonic() - t0, "events": events,
            "trained": offender.trained(ev), "roles": roles, "exits": {p.index: p.returncodes for p in job.run.pods},
            "unhealthy_exits": sum(job.run.pods[i].returncodes.count(UNHEALTHY) for i, r in roles.items() if r == a.node)}


def sources(resumed: list[str | None]) -> str:
    """``"local 24, peer 4"``: where the ranks' resumes after the first fault restored from."""
    return ", ".join(f"{s} {resumed.count(s)}" for s in sorted({str(s) for s in resumed})) or "-"


def _median(xs: list[float]) -> float | str:  # "-": none (a lost node's own launcher detects nothing: it is gone)
    return median(xs) if xs else "-"


def run_row(restart: str, kind: str, a, tmp: Path) -> dict:
    jobs = []
    for j in range(a.jobs):
        print(f"[nodes] --restart {restart}, {kind}: job {j + 1}/{a.jobs} ({a.faults} faults) ...", flush=True)
        jobs.append(run_job(restart, kind, a, tmp / f"{restart.replace('+', '_')}-{kind}-{j}"))
    rec = [r for job in jobs for r in job["recovery"] if r is not None]
    injected = sum(job["injected"] for job in jobs)
    row = {"restart": restart, "fault": kind, "injected": injected, "recovered": f"{len(rec)}/{injected}",
           "median_s": median(rec), "p95_s": p95(rec), "detect_s": _median([d for job in jobs for d in job["detect"]]),
           "respawn_s": _median([d for job in jobs for d in job["respawn"]]),
           "recovery_s": [None if r is None else round(r, 2) for job in jobs for r in job["recovery"]],
           "pod_failures": sum(job["pod_failures"] for job in jobs),
           "job": "ok" if not any(job["error"] for job in jobs) else "FAILED",
           "left_running": sum(len(job["left"]) for job in jobs), "wall_s": sum(job["wall_s"] for job in jobs),
           "resumed_from": sources([s for job in jobs for s in job["sources"]]),
           "trained": [job["trained"] for job in jobs], "unhealthy_exits": sum(job["unhealthy_exits"] for job in jobs),
           "max_rollback": max((r for job in jobs for r in job["rollback"] if r is not None), default=None),
           "restart_log": [job["restart_log"] for job in jobs]}
    errors = [job["error"] for job in jobs if job["error"]] + [f"left running: {job['left']}" for job in jobs if job["left"]]
    if errors:
        row["error"] = "\n".join(errors)
        print(f"[nodes] error: {row['error'][-4000:]}", flush=True)
    print(f"[nodes] --restart {restart}, {kind}: {row['recovered']} recovered, median {row['median_s']:.2f} s", flush=True)
    return row


def parse(argv: list[str]) -> argparse.Namespace:
    ap = Parser(prog="python -m nvrx_lab.bench nodes", description=__doc__.splitlines()[0])
    ap.add_argument("--faults-per-kind", type=int, default=10, help="faults of each kind per restart mode")
    ap.add_argument("--faults-per-job", type=int, default=5, help="faults injected in one Job, --gap steps apart")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--restarts", nargs="+", default=list(MODES), choices=list(MODES), help="the trainer's --restart")
    ap.add_argument("--nodes", type=int, default=4, help="pods (agents), one per node")
    ap.add_argument("--nproc", type=int, default=2, help="workers per node")
    ap.add_argument("--node", type=int, default=2,
                    help="the node rank that faults, in the round that trains (not 0: it hosts the rendezvous store)")
    ap.add_argument("--first-step", type=int, default=6, help="step of the first fault")
    ap.add_argument("--gap", type=int, default=8, help="steps between faults")
    ap.add_argument("--ckpt-interval", type=int, default=3)
    ap.add_argument("--local-ckpt-interval", type=int, default=0,
                    help="the trainer's --local-ckpt-interval (0: off); a lost node loses its memory folder too")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="the trainer's --step-sleep: seconds added to every "
                    "step (a job's step is seconds, the tiny model's 15 ms: restarts and rollbacks are priced in steps)")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0, help="the launcher's steady heartbeat timeout (s)")
    ap.add_argument("--replace-after", type=float, default=0.0,
                    help="seconds before a lost node's replacement pod starts (EKS: minutes to place and start it); 0: at once")
    ap.add_argument("--rdzv-conf", default="", help="extra c10d settings, e.g. keep_alive_interval=1 (default: as shipped)")
    ap.add_argument("--job-timeout", type=float, default=0, help="bound on one Job (s); 0: 120 + 90 per fault")
    ap.add_argument("--quick", action="store_true", help="2 faults per kind, one Job each")
    ap.add_argument("--workdir", default=None, help="keep every Job's folder (logs, FSx) here (default: a temp dir)")
    ap.add_argument("--out", default="build/bench/nodes.json")
    a = ap.parse_args(argv)
    if not 0 < a.node < a.nodes:
        ap.error(f"--node must be 1..{a.nodes - 1} (node 0 hosts the rendezvous store), got {a.node}")
    total = 2 if a.quick else a.faults_per_kind
    a.faults = min(total, a.faults_per_job)
    a.jobs = -(-total // a.faults)
    a.job_timeout = a.job_timeout or 120 + 90 * a.faults  # a node loss on a loaded 2-core box: ~75 s
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nvrx_nodes_") as tmp:
        for restart in a.restarts:
            for kind in a.kinds:
                rows.append(run_row(restart, kind, a, Path(a.workdir or tmp)))
    offender.goodput(rows)
    for row in rows:
        print(f"\nrestart log, --restart {row['restart']}, {row['fault']} (first Job):")
        print("\n".join(f"  {line}" for line in row["restart_log"][0][:16]))
    report("nodes", rows, a.out, "python -m nvrx_lab.bench nodes " + shlex.join(argv),
           extra={"nodes": a.nodes, "nproc_per_node": a.nproc, "faults_per_job": a.faults, "jobs_per_row": a.jobs,
                  "replace_after_s": a.replace_after},
           columns=["restart", "fault", "recovered", "median_s", "p95_s", "detect_s", "respawn_s", "pod_failures", "job",
                    "left_running", "resumed_from", "goodput", "unhealthy_exits", "wall_s"])
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
