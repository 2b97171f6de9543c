"""The JobSet variant: the same pods, restarted as one group, for clusters that run the JobSet controller.

A `JobSet <https://jobset.sigs.k8s.io/>`_ (``jobset.x-k8s.io/v1alpha2``) wraps the Indexed Job of
:mod:`nvrx_lab.eks.render` as its one replicated Job (``node``, one replica, ``nodes`` completions)::

    <name>                 JobSet: failurePolicy, network (headless Service <name>), ttl
      <name>-node-0        child Job: Indexed, backoffLimit 0, the same podFailurePolicy and pod template
        <name>-node-0-<i>  pod i: hostname, JOB_COMPLETION_INDEX=i, DNS <name>-node-0-<i>.<name>

What changes against the plain Indexed Job:

* **The group is the unit of restart.** The child Job has ``backoffLimit: 0``: any counted pod failure
  fails it, and the JobSet recreates *every* pod at once (``failurePolicy.maxRestarts`` group failures:
  10 under Kubernetes restarts, 3 under the launcher), without the Job controller's per-pod back-off
  (10 s doubling, capped at 10 min a pod in the Job controller's code, ``MaxJobPodFailureBackOff``: a node idles that
  long after each failure).
* **Blocking recreate.** ``restartStrategy: BlockingRecreate``: every pod of the old group is gone before the
  first new one is created, so a new pod never resolves ``<jobset>-node-0-0`` to an old pod (or an old pod's
  rendezvous store) that is still terminating.
* **A usage error still fails at once.** A pod that exits 2 fails the child Job through its
  ``podFailurePolicy`` (reason ``PodFailurePolicy``), and the rule ``FailJobSet`` on that reason ends
  the JobSet without a restart.
* **Exclusive placement per node** stays the pod anti-affinity (one pod of the job per node; the pod
  takes every GPU anyway). JobSet's ``exclusive-topology`` annotation is *not* used: with one child
  Job it would put all pods into one topology domain (one node, for ``kubernetes.io/hostname``).
* **The headless Service** is the JobSet controller's (``network.subdomain``), with
  ``publishNotReadyAddresses`` so pods resolve each other before readiness, as with ours.

Gang scheduling and queueing are Kueue's: the label ``kueue.x-k8s.io/queue-name`` (``JobSpec.queue_name``)
makes Kueue admit the JobSet (or the plain Job) only when quota for all its pods is free.
:func:`child_job` turns a JobSet back into the Indexed Job its controller creates, for
:func:`~nvrx_lab.eks.local.local_run`.
"""

from __future__ import annotations

import copy

from nvrx_lab.eks.spec import JobSpec

API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "node"
"""The replicated Job's name: pod hostnames are ``<jobset>-node-0-<i>`` (:attr:`JobSpec.pod_hostname_prefix`)."""


def group_restarts(s: JobSpec) -> int:
    """Whole-group restarts allowed: ``backoff_limit`` (failed pods) over the nodes, or 10 (Kubernetes restarts) / 3
    (the launcher) as for the Indexed Job."""
    if s.backoff_limit is not None:
        return s.backoff_limit // s.nodes
    return 10 if s.mode_info.kubernetes_restarts else 3


def jobset(s: JobSpec, meta: dict, child_spec: dict, child_labels: dict[str, str]) -> dict:
    """The JobSet of ``s``: ``meta`` its metadata (Kueue's queue label there only: Kueue admits the JobSet, not its
    child), ``child_spec`` the Indexed Job's ``spec`` (backoffLimit 0), ``child_labels`` the child Job's labels."""
    return {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": meta, "spec": {
        "network": {"enableDNSHostnames": True, "subdomain": s.name, "publishNotReadyAddresses": True},
        "failurePolicy": {"maxRestarts": group_restarts(s), "restartStrategy": "BlockingRecreate", "rules": [
            {"name": "usage-error", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
        "successPolicy": {"operator": "All"},
        "ttlSecondsAfterFinished": s.ttl_after_finished_s,
        "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                            "template": {"metadata": {"labels": dict(child_labels)}, "spec": child_spec}}],
    }}


def child_job(js: dict) -> dict:
    """The Indexed Job the JobSet controller creates for ``js``'s first replicated Job (replica 0): named
    ``<jobset>-<replicatedJob>-0``, its pods in the JobSet's subdomain."""
    rj = js["spec"]["replicatedJobs"][0]
    if int(rj.get("replicas", 1)) != 1 or len(js["spec"]["replicatedJobs"]) != 1:
        raise ValueError(f"JobSet/{js['metadata']['name']}: a local run takes one replicated Job of one replica")
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": copy.deepcopy(rj["template"].get("metadata", {})),
           "spec": copy.deepcopy(rj["template"]["spec"])}
    job["metadata"].update(name=f"{js['metadata']['name']}-{rj['name']}-0", namespace=js["metadata"].get("namespace"))
    network = js["spec"].get("network") or {}
    job["spec"]["template"]["spec"]["subdomain"] = network.get("subdomain") or js["metadata"]["name"]
    return job


def max_restarts(js: dict) -> int:
    return int((js["spec"].get("failurePolicy") or {}).get("maxRestarts", 0))


def failure_action(js: dict, reason: str) -> str:
    """What the JobSet does when its child Job failed for ``reason`` (``PodFailurePolicy``,
    ``BackoffLimitExceeded``): the action of the first rule that matches it, else ``RestartJobSet``."""
    for rule in (js["spec"].get("failurePolicy") or {}).get("rules", []):
        if not rule.get("onJobFailureReasons") or reason in rule["onJobFailureReasons"]:
            return rule["action"]
    return "RestartJobSet"
