"""``local_run`` of the replicas mode: the coordinator's StatefulSet and every group's Indexed Job as local processes.

The manifests of ``JobSpec(mode="replicas")`` (:mod:`nvrx_lab.eks.replicas`) hold one StatefulSet with its Service and
PodDisruptionBudget, and per replica group a headless Service and an Indexed Job. :class:`LocalReplicas` runs them as
the controllers would:

* **the coordinator** — the StatefulSet's one pod, run as a one-pod :class:`~nvrx_lab.eks.local_job.LocalJob` whose
  failures are all retried (a StatefulSet replaces its pod whatever the exit); its Service's ports become free local
  ports, and its name (``<name>-coordinator[.<ns>[.svc[.cluster.local]]]``) loopback. The PodDisruptionBudget has
  nothing to guard here (no drain, no consolidation) and is left out;
* **each group** — a :class:`~nvrx_lab.eks.local_job.LocalJob` of its own, under the Job controller's rules
  (``backoffLimit``, ``podFailurePolicy``), whose pods dial the coordinator through those ports;
* **the shared secret** — the Secret ``<name>-replica-secret`` that a cluster holds is made here with a random value
  (unless ``options.secrets`` passes one), so the groups authenticate to the coordinator as on EKS;
* **one folder** — every Job shares ``workdir``, so the FSx claim is one directory and ``coordinator.jsonl`` and the
  groups' ``replica<r>.jsonl`` land side by side, as on FSx (:func:`nvrx_lab.replicas.ledger.check_dir` reads them).

The run is over when every group's Job is (succeeded or failed); then the coordinator is stopped, and nothing of it
is left running. :class:`ReplicaRun` holds each Job's :class:`~nvrx_lab.eks.local_pods.LocalRun`, as ``local_run``
reports a single Job.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from nvrx_lab.eks.local_job import OVER, LocalJob, LocalOptions
from nvrx_lab.eks.local_pods import LocalRun
from nvrx_lab.net import SECRET_ENV, wait_for

COORDINATOR_RESTARTS = 1000
"""A StatefulSet never gives up on its pod: the coordinator's failed attempts allowed in a local run."""


@dataclass
class ReplicaRun:
    """What happened to the coordinator and to each group's Job."""

    coordinator: LocalRun
    """The coordinator StatefulSet's pod (index 0): its attempts, logs and exit codes (its status stays ``timeout``:
    a StatefulSet's pod is stopped, never done)."""
    jobs: dict[str, LocalRun] = field(default_factory=dict)
    """Group Job name (``<name>-g<r>``) -> its run, as :func:`~nvrx_lab.eks.local.local_run` reports one Job."""
    status: str = "pending"
    """Succeeded (every group's Job), Failed (one or more failed: ``reason`` names them) or timeout."""
    reason: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "Succeeded"

    @property
    def workdir(self) -> Path:
        return self.coordinator.workdir

    def local_path(self, pod_path: str) -> Path:
        """Where a path on the shared FSx volume (``/fsx/<name>/coordinator.jsonl``) lives on this machine."""
        return self.coordinator.local_path(pod_path)


def _one(manifests: list[dict], kind: str, name: str | None = None) -> dict:
    found = [m for m in manifests if m.get("kind") == kind and name in (None, m["metadata"]["name"])]
    if len(found) != 1:
        raise ValueError(f"manifests: expected exactly one {kind}{f' named {name}' if name else ''}, found {len(found)}")
    return found[0]


def coordinator_job(sts: dict) -> dict:
    """The StatefulSet's pod as a one-pod Indexed Job that retries every failure (a StatefulSet's pod is never done)."""
    if int(sts["spec"].get("replicas", 1)) != 1:
        raise ValueError(f"StatefulSet/{sts['metadata']['name']}: a local run takes one replica")
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": copy.deepcopy(sts["metadata"]),
            "spec": {"completionMode": "Indexed", "completions": 1, "parallelism": 1,
                     "backoffLimit": COORDINATOR_RESTARTS, "template": copy.deepcopy(sts["spec"]["template"])}}


def _with_secrets(options: LocalOptions, manifests: list[dict]) -> LocalOptions:
    """``options`` with a random value for each Secret of the shared key that it does not pass: what
    ``kubectl create secret`` (:func:`~nvrx_lab.eks.replicas.secret_command`) does once on a cluster."""
    refs = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for m in manifests if m.get("kind") in ("StatefulSet", "Job")
            for c in m["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
            if e["name"] == SECRET_ENV and "secretKeyRef" in e.get("valueFrom", {})}
    made = {ref: secrets.token_hex(32) for ref in refs if ref not in options.secrets}
    return dataclasses.replace(options, secrets={**options.secrets, **made}) if made else options


class LocalReplicas:
    """The coordinator and every group's Job of ``manifests``, one :meth:`poll` at a time; a context manager: entering
    starts the coordinator and then the groups, leaving stops whatever still runs (the coordinator last)."""

    def __init__(self, manifests: list[dict], options: LocalOptions | None = None):
        sts = _one(manifests, "StatefulSet")
        name = sts["metadata"]["name"]
        own = ("StatefulSet", "PodDisruptionBudget", "Service", "Job")
        shared = [m for m in manifests if m.get("kind") not in own]  # ConfigMaps, storage
        self.options = _with_secrets(options or LocalOptions(), manifests)
        if self.options.workdir is None:  # one folder for every Job: one FSx claim, side by side
            self.options = dataclasses.replace(self.options, workdir=tempfile.mkdtemp(prefix=f"local-{name}-"))
        self.coordinator = LocalJob([coordinator_job(sts), _one(manifests, "Service", name), *shared], self.options)
        services = {name: self.coordinator.run.ports}
        self.groups = [LocalJob([*(s for s in manifests if s.get("kind") == "Service"
                                   and s["metadata"]["name"] == job["spec"]["template"]["spec"].get("subdomain")),
                                 job, *shared], self.options, services=services)
                       for job in manifests if job.get("kind") == "Job"]
        if not self.groups:
            raise ValueError(f"manifests: StatefulSet/{name} but no Job of replica groups")
        self.run = ReplicaRun(self.coordinator.run, {g.name: g.run for g in self.groups})
        self._stack = contextlib.ExitStack()
        self.t0 = time.monotonic()

    def __enter__(self) -> LocalReplicas:
        self.t0 = time.monotonic()
        with contextlib.ExitStack() as stack:  # a group that fails to start stops those started before it
            stack.callback(self.coordinator.close, 0)
            stack.enter_context(self.coordinator)
            for g in self.groups:
                stack.callback(g.close, 0)
                stack.enter_context(g)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self) -> bool:
        """One pass of every controller; True once every group's Job is over."""
        self.coordinator.poll()
        over = [g.poll() for g in self.groups]
        return all(over)

    def close(self) -> ReplicaRun:
        """Stop the groups still running, then the coordinator; set the run's status from its Jobs'."""
        for g in self.groups:
            g.close()
        self.coordinator.close()
        self._stack.close()
        run, statuses = self.run, {name: r.status for name, r in self.run.jobs.items()}
        failed = [f"Job/{name}: {r.reason}" for name, r in run.jobs.items() if r.status == "Failed"]
        run.status = ("Succeeded" if all(s == "Succeeded" for s in statuses.values()) else
                      "Failed" if failed and all(s in OVER for s in statuses.values()) else "timeout")
        run.reason = "; ".join(failed)
        run.wall_s = time.monotonic() - self.t0
        return run


def run_replicas(manifests: list[dict], options: LocalOptions) -> ReplicaRun:
    """:func:`~nvrx_lab.eks.local.local_run` of the replicas mode: until every group's Job is over, or the timeout."""
    with LocalReplicas(manifests, options) as job, contextlib.suppress(TimeoutError):  # close(): status "timeout"
        wait_for(job.poll, options.timeout_s, f"{len(job.groups)} replica groups' Jobs to end", interval=options.poll_s)
    return job.run


__all__ = ["LocalReplicas", "ReplicaRun", "coordinator_job", "run_replicas"]
