"""``local_run(manifests)``: a job's pods as local processes, with the shipped command lines, until the job ends.

The pods of one Indexed Job (or a JobSet) run under :class:`~nvrx_lab.eks.local_job.LocalJob` (the Job and JobSet
controllers' rules, lost nodes, the settings of :class:`~nvrx_lab.eks.local_job.LocalOptions`); the replicas mode's
coordinator StatefulSet and group Jobs under :class:`~nvrx_lab.eks.local_replicas.LocalReplicas`. What each pod runs,
and how a laptop stands in for a cluster, is :func:`~nvrx_lab.eks.local_plan.plan`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses

from nvrx_lab.eks.local_job import LocalJob, LocalOptions, kill_tree
from nvrx_lab.eks.local_plan import plan
from nvrx_lab.eks.local_pods import LocalPod, LocalRun, PodEvent
from nvrx_lab.eks.local_replicas import ReplicaRun, run_replicas
from nvrx_lab.net import wait_for


def local_run(manifests: list[dict], options: LocalOptions | None = None, /, **settings) -> LocalRun | ReplicaRun:
    """Run the Indexed Job (or JobSet) of ``manifests`` here until it ends (see the module docstring) and return it;
    the settings are ``options``, or its fields as keywords: ``local_run(manifests, workdir=d, timeout_s=80)``. The
    replicas mode's manifests (a coordinator StatefulSet and a Job per group) run under
    :class:`~nvrx_lab.eks.local_replicas.LocalReplicas` and give a :class:`~nvrx_lab.eks.local_replicas.ReplicaRun`."""
    options = dataclasses.replace(options or LocalOptions(), **settings)
    if any(m.get("kind") == "StatefulSet" for m in manifests):
        return run_replicas(manifests, options)
    with LocalJob(manifests, options) as job, contextlib.suppress(TimeoutError):  # close(): status "timeout"
        wait_for(job.poll, options.timeout_s, f"Job/{job.name} to end", interval=options.poll_s)
    return job.run


__all__ = ["LocalJob", "LocalOptions", "LocalPod", "LocalRun", "PodEvent", "ReplicaRun", "kill_tree", "local_run", "plan"]
