"""The replicas mode's objects: a coordinator StatefulSet behind a Service, and one Indexed Job per replica group.

``JobSpec(mode="replicas", replica_groups=R, nodes=N, min_replicas=M)`` renders, after the Namespace and storage::

    <name>-coordinator     Service (ClusterIP): the quorum port P and the TCPStore port P+1
    <name>-coordinator     StatefulSet, 1 replica: python -m nvrx_lab.replicas.coordinator, CPU only
    <name>-coordinator     PodDisruptionBudget, minAvailable 1: no drain or consolidation evicts the coordinator
    <name>-replica-secret  (not rendered: made once, see secret_command) the coordinator's and every rank's key
    <name>-g<r>            headless Service of group r: pod DNS <name>-g<r>-<i>.<name>-g<r>
    <name>-g<r>            Indexed Job of group r: N pods, torchrun's c10d rendezvous on its index 0

Each group's Job is the torchrun modes' Job (:func:`nvrx_lab.eks.render.job`: the same GPUs, EFA, FSx,
``podFailurePolicy`` and pod anti-affinity), renamed, with its own ``REPLICA_ID`` and rank-0 host. Why this shape:

* **One Job per group**, not one Job of all pods: a group's failure (a pod lost, torchrun out of restarts) is that
  Job's alone, and Kubernetes replaces only its pods (``backoffLimit``); the other groups' pods never stop. A JobSet
  is refused: it recreates every child Job when one fails.
* **Inside a group**, torchrun replaces failed workers in the pod (``--max-restarts``, ``JobSpec.max_restarts``);
  a replacement takes a live group's state over the quorum's group, so no checkpoint is written or read.
* **The coordinator** can be restarted (the ranks reconnect to the same Service address, and a restarted coordinator
  goes on from the last committed step); what matters is *at most one*, or the groups would split between two
  quorums. A StatefulSet of one replica never starts a replacement pod before the old pod object is gone (a
  Deployment, ``Recreate`` or not, may run two during a network partition: the old pod on an unreachable node is not
  confirmed dead). The cost: a coordinator on a lost node is replaced only once that node's pod is deleted: evicted
  after the 60 s lost-node tolerations, it stays terminating until its kubelet confirms, the node lifecycle
  controller deletes the Node (its instance gone) or someone force-deletes the pod. The ranks wait for it meanwhile
  (``--replica-reconnect-timeout``, 600 s by default) and, once it is back, go on from the last committed step. A
  PodDisruptionBudget (``minAvailable: 1``) and ``karpenter.sh/do-not-disrupt`` keep a drain or a consolidation from
  evicting it voluntarily. It runs on a CPU node (no GPU taints tolerated), behind a ClusterIP Service whose name
  survives a replaced pod. It tells every rank its TCPStore's port, so the groups dial ``<name>-coordinator`` on
  both ports and the Service forwards both.
* **A shared secret** (``$NVRX_LAB_REPLICA_SECRET``, :func:`nvrx_lab.net.shared_secret`): the coordinator opens each
  connection with a nonce and a rank answers with its HMAC, so only this job's ranks join its quorums. Every pod reads
  it from the Secret ``<name>-replica-secret`` (key ``secret``), which is never rendered (a manifest in git would
  publish it): :func:`secret_command` makes it once, with a random value. The reference is not optional: a pod without
  the Secret stays in ``CreateContainerConfigError`` saying so, rather than start and be refused.
* **Event streams** land in the run's folder on FSx: ``coordinator.jsonl`` and ``replica<r>.jsonl``, the files
  :func:`nvrx_lab.replicas.ledger.check_dir` reads to prove every sample was trained exactly once.
"""

from __future__ import annotations

import copy

from nvrx_lab.eks.commands import Flag, flag_array
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.net import SECRET_ENV

GROUP_LABEL = "nvrx-lab/replica-group"
"""The replica group of a group's Job, Service and pods: its headless Service selects only its own pods."""
COMPONENT = "app.kubernetes.io/component"
CONTAINER = "coordinator"
SECRET_KEY = "secret"
"""The key of the shared secret in the Secret ``<name>-replica-secret``."""
DO_NOT_DISRUPT = {"karpenter.sh/do-not-disrupt": "true"}
"""Karpenter never consolidates (or otherwise voluntarily disrupts) the node of a pod with this annotation."""
RESOURCES = {"cpu": "1", "memory": "2Gi"}
"""The coordinator's request: one message in and one out per rank and step, and a TCPStore; memory for torch."""


def coordinator_name(s: JobSpec) -> str:
    return f"{s.name}-coordinator"


def secret_name(s: JobSpec) -> str:
    return f"{s.name}-replica-secret"


def secret_command(s: JobSpec) -> str:
    """The one command that makes the job's Secret with a random 32-byte key (before the first apply)."""
    return (f"kubectl -n {s.namespace} create secret generic {secret_name(s)} "
            f'--from-literal={SECRET_KEY}="$(openssl rand -hex 32)"')


def secret_env(s: JobSpec) -> dict:
    """The container's ``$NVRX_LAB_REPLICA_SECRET``, by reference to the Secret (required: never started without)."""
    return {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name(s), "key": SECRET_KEY}}}


def group_name(s: JobSpec, r: int) -> str:
    return f"{s.name}-g{r}"


def group_env(s: JobSpec) -> list[tuple[str, str, str]]:
    """(name, value, why) of what a group's pods know of the replica layer; each group's Job sets its own REPLICA_ID."""
    return [("COORDINATOR_HOST", coordinator_name(s), "the coordinator's Service: a stable name (and ClusterIP) whichever "
                                                      "pod runs it"),
            ("COORDINATOR_PORT", str(s.coordinator_port), "the coordinator's quorum port; it announces its TCPStore's "
                                                          "port (the next one) to every rank"),
            ("REPLICA_ID", "0", "this Job's replica group, 0..replica_groups-1"),
            ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1", "torchrun restarts a group's workers in the pod: each round gets a "
             "store of its own (the shared one keeps the last round's gloo addresses, and a new worker dialled a dead one)")]


def coordinator_env(s: JobSpec) -> list[tuple[str, str, str]]:
    """(name, value, why) of the coordinator's variables (a local run maps each whole value: ports, 0.0.0.0)."""
    return [("LISTEN_HOST", "0.0.0.0", "every interface of the pod: the Service forwards to it"),
            ("COORDINATOR_PORT", str(s.coordinator_port), "the coordinator's quorum port; it announces its TCPStore's "
                                                          "port (the next one) to every rank"),
            ("STORE_PORT", str(s.coordinator_port + 1), "the TCPStore where every rank writes the address of its end of "
                                                            "the cross-replica ring"),
            ("RUN_DIR", s.run_dir, "this job's directory on FSx: the coordinator's events beside the groups'")]


def coordinator_flags(s: JobSpec) -> list[Flag]:
    return [
        Flag("--host", "${LISTEN_HOST}", "listen on every interface of the pod"),
        Flag("--port", "${COORDINATOR_PORT}", "the quorum protocol: one connection from every rank of every group"),
        Flag("--store-port", "${STORE_PORT}", "a fixed port the Service forwards (0 would pick any)"),
        Flag("--replicas", str(s.replica_groups), "replica groups of the job: the first quorum waits for every one"),
        Flag("--min-replicas", str(s.min_replicas), "fewest groups a new step starts with; fewer alive wait for a "
                                                    "replacement"),
        Flag("--metrics", "${RUN_DIR}/coordinator.jsonl", "quorums, commits and lost groups on FSx, beside the groups' "
                                                          "replica<r>.jsonl: the data ledger reads both"),
    ]


def coordinator_script(s: JobSpec) -> str:
    """The ``bash -c`` script of the coordinator's container."""
    return "\n".join([
        f"# nvrx_lab mode replicas: the coordinator of {s.replica_groups} replica groups ({group_name(s, 0)}..).",
        "# Rendered by `python -m nvrx_lab.eks render`; edit the JobSpec, not this script.",
        "set -euo pipefail",
        'mkdir -p "${RUN_DIR}"',
        *flag_array("coordinator_args", coordinator_flags(s)),
        'exec python -m nvrx_lab.replicas.coordinator "${coordinator_args[@]}"',
    ]) + "\n"


def _ports(s: JobSpec) -> list[tuple[str, int]]:
    return [("quorum", s.coordinator_port), ("store", s.coordinator_port + 1)]


def coordinator_service(s: JobSpec, meta: dict, selector: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": selector,
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in _ports(s)]}}


def statefulset(s: JobSpec, meta: dict, pod_labels: dict[str, str], group_pod: dict) -> dict:
    """The coordinator's StatefulSet (one pod, never two at once); ``group_pod`` (a group's pod spec) lends it the FSx
    volume, the lost-node tolerations and the priority class."""
    container = {
        "name": CONTAINER, "image": s.image, "imagePullPolicy": s.image_pull_policy,
        "args": ["/bin/bash", "-c", coordinator_script(s)],
        "env": [*({"name": k, "value": v} for k, v, _ in coordinator_env(s)), secret_env(s)],
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in _ports(s)],
        "readinessProbe": {"tcpSocket": {"port": "quorum"}, "periodSeconds": 2},
        "resources": {"requests": dict(RESOURCES), "limits": {"memory": RESOURCES["memory"]}},
        "securityContext": {"privileged": False, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "fsx", "mountPath": s.mount_path}],
    }
    pod = {"automountServiceAccountToken": False, "enableServiceLinks": False,
           "tolerations": [t for t in group_pod["tolerations"] if t["effect"] == "NoExecute"],
           "containers": [container],
           "volumes": [v for v in group_pod["volumes"] if v["name"] == "fsx"]}
    if "priorityClassName" in group_pod:
        pod["priorityClassName"] = group_pod["priorityClassName"]
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": {
        "replicas": 1, "serviceName": coordinator_name(s), "podManagementPolicy": "OrderedReady",
        "selector": {"matchLabels": dict(pod_labels)},
        "template": {"metadata": {"labels": dict(pod_labels), "annotations": dict(DO_NOT_DISRUPT)}, "spec": pod}}}


def disruption_budget(meta: dict, pod_labels: dict[str, str]) -> dict:
    """The coordinator's PodDisruptionBudget: a drain or a consolidation never evicts its one pod (the eviction API
    refuses; a deletion or a lost node still replaces it)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
            "spec": {"minAvailable": 1, "selector": {"matchLabels": dict(pod_labels)}}}


def group(s: JobSpec, service: dict, job: dict, r: int) -> list[dict]:
    """Group ``r``'s headless Service and Indexed Job: ``service`` and ``job`` (as the torchrun modes render them)
    renamed, selecting only the group's pods, with the group's rank-0 host and REPLICA_ID."""
    name, label = group_name(s, r), {GROUP_LABEL: str(r)}
    svc, j = copy.deepcopy(service), copy.deepcopy(job)
    for obj in (svc, j):
        obj["metadata"]["name"] = name
        obj["metadata"]["labels"] |= label
    svc["spec"]["selector"] |= label
    template = j["spec"]["template"]
    template["metadata"]["labels"] |= label
    pod = template["spec"]
    pod["subdomain"] = name
    for term in pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]:
        term["labelSelector"]["matchLabels"][COMPONENT] = "training"  # one training pod per node, whatever its group
    pod["containers"][0]["env"].append(secret_env(s))
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    env["RANK0_HOST"]["value"] = f"{name}-0.{name}"
    env["REPLICA_ID"]["value"] = str(r)
    return [svc, j]


def replica_objects(s: JobSpec, service: dict, job: dict) -> list[dict]:
    """The coordinator's Service, StatefulSet and PodDisruptionBudget, then every group's Service and Job (the order
    to create them)."""
    pod_labels = job["spec"]["template"]["metadata"]["labels"] | {COMPONENT: "coordinator"}
    meta = {"name": coordinator_name(s), "namespace": s.namespace, "labels": dict(pod_labels)}
    selector = {k: pod_labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", COMPONENT)}
    out = [coordinator_service(s, copy.deepcopy(meta), selector),
           statefulset(s, copy.deepcopy(meta), pod_labels, job["spec"]["template"]["spec"]),
           disruption_budget(copy.deepcopy(meta), pod_labels)]
    for r in range(s.replica_groups):
        out += group(s, service, job, r)
    return out
